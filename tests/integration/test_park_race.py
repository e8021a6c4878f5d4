"""An enable that races a statement parking its endpoint's deliveries leaves none parked
(found by a soak run: one delivery in about thirty enables at 50 events/s stayed parked for
good on an enabled endpoint, never sent, never dead-lettered). A statement that read the
endpoint disabled in its snapshot wrote its parked row after the enable had unparked what
it could see. Now the parking statement holds the endpoint's row (FOR SHARE, migration
0016) until it commits: the enable waits for it, then unparks that row too.

Both sides run here on real connections, in the order the race needs: the parking
transaction has written its row and not committed when the enable starts."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest

from fluxora_webhooks import endpoints
from fluxora_webhooks.outbox import Completion, Outcome, claim_due, complete

pytestmark = pytest.mark.integration


async def _disabled_endpoint(conn: psycopg.AsyncConnection[Any]) -> str:
    """An endpoint of tenant acme, disabled by SQL (nothing of it parked yet)."""
    endpoint, _ = await endpoints.create(conn, url="https://acme.example/hook", tenant="acme")
    await conn.execute(
        "UPDATE webhook_endpoints SET state = 'disabled', disabled_reason = 'manual' WHERE id = %s",
        (endpoint.id,),
    )
    return endpoint.id


async def _enable_behind(
    database_url: str, parking: psycopg.AsyncConnection[Any], endpoint_id: str
) -> bool:
    """Enable the endpoint while ``parking`` holds its uncommitted parked row; then commit
    ``parking``. Whether the enable waited for that commit."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as other:
        enabling = asyncio.create_task(endpoints.enable(other, endpoint_id))
        await asyncio.sleep(0.5)
        waited = not enabling.done()
        await parking.commit()
        enabled = await asyncio.wait_for(enabling, 10)
    assert enabled.state == "enabled"
    return waited


async def _left_parked(conn: psycopg.AsyncConnection[Any], endpoint_id: str) -> list[Any]:
    cur = await conn.execute(
        "SELECT id, hold, created_at <= now() FROM webhook_outbox"
        " WHERE endpoint_id = %s AND NOT processed ORDER BY id",
        (endpoint_id,),
    )
    return await cur.fetchall()


async def test_a_delivery_parked_at_its_claim_while_the_endpoint_is_enabled_is_sent(
    database_url: str,
) -> None:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        endpoint_id = await _disabled_endpoint(conn)
        await conn.execute(
            "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload, endpoint_id)"
            " VALUES ('acme', 's', 'order.paid', '{}', %s)",
            (endpoint_id,),
        )
        async with await psycopg.AsyncConnection.connect(database_url) as parking:
            [row] = await claim_due(parking, 10)  # a dispatcher's batch: the row is parked
            parked = Completion(row.id, Outcome.PARKED, endpoint_id=endpoint_id)
            await complete(parking, [parked], {row.id: row.partition_at})
            waited = await _enable_behind(database_url, parking, endpoint_id)
        assert await _left_parked(conn, endpoint_id) == [(row.id, None, True)]  # due now
        assert waited  # for the transaction that parked it


async def test_an_event_routed_to_the_endpoint_while_it_is_enabled_is_sent(
    database_url: str,
) -> None:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        endpoint_id = await _disabled_endpoint(conn)
        await conn.execute(
            "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload)"
            " VALUES ('acme', 's', 'order.paid', '{}')"
        )
        async with await psycopg.AsyncConnection.connect(database_url) as parking:
            [event] = await claim_due(parking, 10)  # routed: its delivery is written parked
            routed = Completion(event.id, Outcome.ROUTED)
            await complete(parking, [routed], {event.id: event.partition_at}, route=[event.id])
            waited = await _enable_behind(database_url, parking, endpoint_id)
        [(_, hold, due)] = await _left_parked(conn, endpoint_id)
        assert (hold, due) == (None, True)
        assert waited


async def test_a_delivery_stays_parked_while_its_endpoint_stays_disabled(
    database_url: str,
) -> None:
    """The lock changes nothing else: no enable, the row is parked as before."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        endpoint_id = await _disabled_endpoint(conn)
        await conn.execute(
            "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload, endpoint_id)"
            " VALUES ('acme', 's', 'order.paid', '{}', %s)",
            (endpoint_id,),
        )
        async with conn.transaction():
            [row] = await claim_due(conn, 10)
            parked = Completion(row.id, Outcome.PARKED, endpoint_id=endpoint_id)
            await complete(conn, [parked], {row.id: row.partition_at})
        assert await _left_parked(conn, endpoint_id) == [(row.id, "parked", False)]
