"""An enable that races a statement parking its endpoint's deliveries leaves none parked for
good (found by a soak run: one delivery in about thirty enables at 50 events/s stayed parked
on an enabled endpoint, never sent, never dead-lettered). A statement that read the
endpoint disabled in its snapshot commits its parked row after the enable's unpark, which
could not see it; the dispatchers' sweep makes such rows due again.

The race runs here on real connections, in the order it needs: the parking transaction
has written its row and not committed when the enable commits."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest

from fluxora_webhooks import dispatcher as dispatcher_module
from fluxora_webhooks import endpoints
from fluxora_webhooks.outbox import Completion, Outcome, claim_due, complete
from tests.support.api import LOOPBACK
from tests.support.dispatch import make_settings, running_dispatcher
from tests.support.receiver import Receiver

pytestmark = pytest.mark.integration


async def _disabled_endpoint(conn: psycopg.AsyncConnection[Any], url: str) -> str:
    """An endpoint of tenant acme, disabled by SQL (nothing of it parked yet)."""
    endpoint, _ = await endpoints.create(conn, url=url, tenant="acme", allowed_networks=LOOPBACK)
    await conn.execute(
        "UPDATE webhook_endpoints SET state = 'disabled', disabled_reason = 'manual' WHERE id = %s",
        (endpoint.id,),
    )
    return endpoint.id


async def _parked_behind_an_enable(database_url: str, endpoint_id: str) -> int:
    """A batch parks the endpoint's delivery (it read the endpoint disabled) and commits
    after an enable committed: the row the enable could not see. Returns its id."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload, endpoint_id)"
            " VALUES ('acme', 's', 'order.paid', '{\"n\": 1}', %s)",
            (endpoint_id,),
        )
        async with await psycopg.AsyncConnection.connect(database_url) as parking:
            [row] = await claim_due(parking, 10)
            parked = Completion(row.id, Outcome.PARKED)
            await complete(parking, [parked], {row.id: row.partition_at})
            enabled = await endpoints.enable(conn, endpoint_id)  # does not wait for it
            assert enabled.state == "enabled"
            await parking.commit()
    return row.id


async def _pending(conn: psycopg.AsyncConnection[Any], endpoint_id: str) -> list[Any]:
    cur = await conn.execute(
        "SELECT id, hold, created_at <= now() FROM webhook_outbox"
        " WHERE endpoint_id = %s AND NOT processed ORDER BY id",
        (endpoint_id,),
    )
    return await cur.fetchall()


async def test_the_sweep_makes_a_delivery_parked_behind_an_enable_due(database_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        endpoint_id = await _disabled_endpoint(conn, "https://acme.example/hook")
        row_id = await _parked_behind_an_enable(database_url, endpoint_id)
        # The race's outcome: parked on an enabled endpoint.
        assert await _pending(conn, endpoint_id) == [(row_id, "parked", False)]
        assert await endpoints.unpark_stragglers(conn) == 1
        assert await _pending(conn, endpoint_id) == [(row_id, None, True)]  # due now
        assert await endpoints.unpark_stragglers(conn) == 0  # nothing left to do


async def test_the_sweep_leaves_a_disabled_endpoints_deliveries_parked(
    database_url: str,
) -> None:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        endpoint_id = await _disabled_endpoint(conn, "https://acme.example/hook")
        await conn.execute(
            "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload, endpoint_id)"
            " VALUES ('acme', 's', 'order.paid', '{}', %s)",
            (endpoint_id,),
        )
        await endpoints.disable(conn, endpoint_id)  # parks it
        [(row_id, hold, _)] = await _pending(conn, endpoint_id)
        assert hold == "parked"
        assert await endpoints.unpark_stragglers(conn) == 0
        assert await _pending(conn, endpoint_id) == [(row_id, "parked", False)]


async def test_a_running_dispatcher_sends_a_delivery_parked_behind_an_enable(
    database_url: str, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dispatcher_module, "SWEEP_S", 0.2)
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        endpoint_id = await _disabled_endpoint(conn, receiver.url)
    await _parked_behind_an_enable(database_url, endpoint_id)
    settings = make_settings("", allowed_networks=LOOPBACK)
    async with running_dispatcher(settings, database_url):
        await receiver.wait_for(1, timeout=20)
    assert [json.loads(hit.body) for hit in receiver.received] == [{"n": 1}]
