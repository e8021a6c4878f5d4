"""Fan-out (SPEC 10): one event reaches every enabled endpoint of its tenant whose filter
matches, each delivery with its own id and the endpoint's own secret; no other tenant's
endpoint ever sees it; the built-in default endpoint receives its tenant's events beside
them; an event no endpoint subscribes to is recorded as unrouted."""

from __future__ import annotations

import base64
import dataclasses
import ipaddress
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
import pytest_asyncio
from standardwebhooks import Webhook

from fluxora_webhooks import endpoints, enqueue, verify
from fluxora_webhooks.settings import Settings
from tests.support.dispatch import SECRET, make_settings, rows, running_dispatcher, wait_until
from tests.support.receiver import Receiver

pytestmark = pytest.mark.integration

LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"),)


@pytest_asyncio.fixture
async def receivers() -> AsyncIterator[list[Receiver]]:
    started = [Receiver() for _ in range(5)]
    for r in started:
        await r.start()
    try:
        yield started
    finally:
        for r in started:
            await r.stop()


def settings_for(default: Receiver | None, **overrides: Any) -> Settings:
    base = make_settings(default.url if default else "", allowed_networks=LOOPBACK)
    if default is None:
        base = dataclasses.replace(base, secret=b"")
    return dataclasses.replace(base, **overrides)


async def add(conn: psycopg.AsyncConnection[Any], r: Receiver, **kw: Any) -> tuple[str, str]:
    endpoint, secret = await endpoints.create(conn, url=r.url, allowed_networks=LOOPBACK, **kw)
    return endpoint.id, secret


async def test_the_fan_out_matrix(database_url: str, receivers: list[Receiver]) -> None:
    default, a_all, a_stream, b_exact, b_other = receivers
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        ep_a_all, secret_a_all = await add(conn, a_all, tenant="acme")
        ep_a_stream, secret_a_stream = await add(
            conn, a_stream, tenant="acme", event_types=["stream.*"]
        )
        ep_b_exact, secret_b = await add(conn, b_exact, tenant="bolt", event_types=["invoice.paid"])
        await add(conn, b_other, tenant="bolt", event_types=["nothing.*"])
        async with conn.transaction():
            await enqueue(
                conn, tenant="acme", stream_id="s1", event_type="stream.created", payload={"n": 1}
            )
            await enqueue(
                conn, tenant="acme", stream_id="s1", event_type="invoice.paid", payload={"n": 2}
            )
            await enqueue(
                conn, tenant="bolt", stream_id="s2", event_type="invoice.paid", payload={"n": 3}
            )
            await enqueue(
                conn, tenant="bolt", stream_id="s2", event_type="stream.created", payload={"n": 4}
            )
            await enqueue(conn, stream_id="s3", event_type="stream.created", payload={"n": 5})
    async with running_dispatcher(settings_for(default), database_url):
        await wait_until(lambda: _settled(database_url), what="all delivered")

    def got(r: Receiver) -> list[int]:
        import json

        return sorted(json.loads(x.body)["n"] for x in r.received)

    assert got(a_all) == [1, 2]
    assert got(a_stream) == [1]
    assert got(b_exact) == [3]
    assert got(b_other) == []
    assert got(default) == [5]  # the default tenant's events only
    # Each (event, endpoint) pair has its own delivery id.
    ids = [x.delivery_id for r in receivers for x in r.received]
    assert len(ids) == len(set(ids)) == 5
    # Each endpoint's own secret signs: both schemes, and the standardwebhooks package.
    for r, secret in ((a_all, secret_a_all), (a_stream, secret_a_stream), (b_exact, secret_b)):
        for hit in r.received:
            assert verify(hit.body, hit.headers, secret) == hit.delivery_id
            assert verify(hit.body, hit.headers, secret, scheme="fluxora") == hit.delivery_id
            Webhook(secret).verify(hit.body, hit.headers)
    for hit in default.received:
        Webhook("whsec_" + base64.b64encode(SECRET).decode()).verify(hit.body, hit.headers)
    # The unrouted event (bolt's stream.created matches no bolt endpoint) is recorded.
    outcomes = dict(
        (n, o)
        for n, o in await rows(
            database_url,
            "SELECT (payload->>'n')::int, outcome FROM webhook_outbox WHERE event_id IS NULL",
        )
    )
    assert outcomes[4] == "unrouted"
    assert ep_a_all != ep_a_stream != ep_b_exact


async def test_an_event_without_a_default_endpoint_is_routed_and_recorded(
    database_url: str, receivers: list[Receiver]
) -> None:
    target = receivers[0]
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await add(conn, target)
        async with conn.transaction():
            await enqueue(conn, stream_id="s", event_type="stream.created", payload={})
            await enqueue(
                conn, tenant="nobody", stream_id="s", event_type="stream.created", payload={}
            )
    async with running_dispatcher(settings_for(None), database_url):
        await target.wait_for(1)
        await wait_until(lambda: _settled(database_url), what="settled")
    found = await rows(
        database_url,
        "SELECT tenant, outcome FROM webhook_outbox WHERE event_id IS NULL ORDER BY tenant",
    )
    assert found == [("", "routed"), ("nobody", "unrouted")]


async def test_an_endpoint_receives_only_events_enqueued_after_it_was_created(
    database_url: str, receivers: list[Receiver]
) -> None:
    target = receivers[0]
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await enqueue(conn, stream_id="s", event_type="stream.created", payload={"n": "before"})
        await add(conn, target)
        await enqueue(conn, stream_id="s", event_type="stream.created", payload={"n": "after"})
    async with running_dispatcher(settings_for(None), database_url):
        await target.wait_for(1)
        await wait_until(lambda: _settled(database_url), what="settled")
    assert [x.body for x in target.received] == [b'{"n": "after"}']


async def _settled(database_url: str) -> bool:
    [(pending,)] = await rows(
        database_url, "SELECT count(*) FROM webhook_outbox WHERE NOT processed"
    )
    return int(pending) == 0
