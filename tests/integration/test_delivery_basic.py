"""Enqueue in a transaction, deliver over real HTTP, and the request as SPEC section 3."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from typing import Any

import psycopg
import pytest
from standardwebhooks.webhooks import Webhook

from fluxora_webhooks.outbox import enqueue
from tests.support.api import serving
from tests.support.dispatch import (
    SECRET,
    make_settings,
    pending,
    rows,
    running_dispatcher,
    wait_until,
)
from tests.support.receiver import Receiver

pytestmark = pytest.mark.integration


async def test_committed_event_is_delivered_signed_and_marked(
    database_url: str, receiver: Receiver
) -> None:
    payload = {"stream": "s-1", "amount": "12.50", "nested": {"b": 1, "a": [1, 2]}}
    async with await psycopg.AsyncConnection.connect(database_url) as conn, conn.transaction():
        delivery_id = await enqueue(
            conn, stream_id="s-1", event_type="stream.created", payload=payload
        )

    async with running_dispatcher(make_settings(receiver.url), database_url):
        await receiver.wait_for(1)
        await wait_until(lambda: _all_processed(database_url), what="row processed")

    (got,) = receiver.received
    assert json.loads(got.body) == payload
    h = got.headers
    assert h["content-type"] == "application/json"
    assert h["user-agent"].startswith("fluxora-webhooks/")
    assert h["x-fluxora-delivery-id"] == delivery_id == h["webhook-id"]
    assert h["x-fluxora-event"] == "stream.created"
    assert h["x-fluxora-attempt"] == "1"
    assert h["x-fluxora-timestamp"] == h["webhook-timestamp"]
    expected = hmac.new(SECRET, h["x-fluxora-timestamp"].encode() + b"." + got.body, hashlib.sha256)
    assert h["x-fluxora-signature"] == expected.hexdigest()
    # The Standard Webhooks signature verifies with the reference package.
    wh = Webhook("whsec_" + base64.b64encode(SECRET).decode())
    assert wh.verify(got.body, h) == payload
    # The body is PostgreSQL's canonical jsonb text.
    (stored,) = await rows(
        database_url, "SELECT payload::text, outcome, status_code FROM webhook_outbox"
    )
    assert got.body == stored[0].encode()
    assert stored[1:] == ("delivered", 200)


async def test_rolled_back_transaction_sends_nothing(database_url: str, receiver: Receiver) -> None:
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        with pytest.raises(RuntimeError):
            async with conn.transaction():
                await enqueue(conn, stream_id="s-1", event_type="stream.created", payload={})
                raise RuntimeError("business write failed")
        async with conn.transaction():
            await enqueue(conn, stream_id="s-2", event_type="stream.created", payload={"ok": 1})

    async with running_dispatcher(make_settings(receiver.url), database_url):
        await receiver.wait_for(1)
        await wait_until(lambda: _all_processed(database_url), what="row processed")
    assert [json.loads(r.body) for r in receiver.received] == [{"ok": 1}]
    count = await rows(database_url, "SELECT count(*) FROM webhook_outbox")
    assert count == [(1,)]


def test_sync_enqueue_with_plain_sql_producer(database_url: str) -> None:
    with psycopg.connect(database_url) as conn:
        with conn.transaction():
            delivery_id = enqueue(conn, stream_id="s", event_type="e.x", payload=[1, "two"])
            conn.execute(
                "INSERT INTO webhook_outbox (stream_id, event_type, payload)"
                " VALUES (%s, %s, %s::jsonb)",
                ("s2", "e.y", '{"k": "v"}'),
            )
        got = conn.execute(
            "SELECT delivery_id::text, attempt, processed FROM webhook_outbox ORDER BY id"
        ).fetchall()
    assert got[0] == (delivery_id, 1, False)
    assert got[1][1:] == (1, False) and got[1][0] != delivery_id


def test_enqueue_rejects_event_type_unfit_for_a_header(database_url: str) -> None:
    with psycopg.connect(database_url) as conn, pytest.raises(ValueError, match="event_type"):
        enqueue(conn, stream_id="s", event_type="bad\r\nx-injected: 1", payload={})


@pytest.mark.parametrize("tenant", ["acme corp", "!operator", "-acme", "a" * 129, None])
def test_enqueue_rejects_a_tenant_the_api_and_cli_refuse(database_url: str, tenant: Any) -> None:
    """A tenant no endpoint can have would be recorded as unrouted, reaching no one; the
    operator's own tenant is the dispatcher's, not a producer's. Nothing is written."""
    with psycopg.connect(database_url) as conn:
        with pytest.raises(ValueError, match="tenant must be empty"):
            enqueue(conn, stream_id="s", event_type="e", payload={}, tenant=tenant)
        conn.rollback()
        assert conn.execute("SELECT count(*) FROM webhook_outbox").fetchone() == (0,)
        enqueue(conn, stream_id="s", event_type="e", payload={}, tenant="acme-1.eu:x@y_z")


async def _all_processed(database_url: str) -> bool:
    return await pending(database_url) == 0


async def test_the_dispatchers_sessions_are_named_unless_the_url_names_them(
    database_url: str, receiver: Receiver
) -> None:
    """An operator tells the dispatcher's sessions from the producers' in pg_stat_activity;
    an application_name the URL gives stands."""

    async def names() -> set[str]:
        found = await rows(
            database_url,
            "SELECT application_name FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()",
        )
        return {str(name) for (name,) in found}

    async with running_dispatcher(make_settings(receiver.url), database_url):
        assert "fluxora-webhooks dispatcher" in await names()
    separator = "&" if "?" in database_url else "?"
    named = f"{database_url}{separator}application_name=billing-webhooks"
    async with running_dispatcher(make_settings(receiver.url), named):
        seen = await names()
    assert "billing-webhooks" in seen and "fluxora-webhooks dispatcher" not in seen
    # The management API's sessions too (they were unnamed beside the dispatcher's).
    async with serving(database_url) as api:
        assert (await api.get("/api/v1/endpoints")).status == 200
        assert "fluxora-webhooks api" in await names()
