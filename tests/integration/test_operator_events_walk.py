"""Operator events as an on-call team's alerting reads them (SPEC 12): each notice is signed
with the operator secret and says when it happened (a dead letter's ``dead_at``, a disabled
endpoint's ``failing_since``), not only when the request was sent (retries of the notice
itself send it later), and carries no tenant's URL or secret."""

from __future__ import annotations

import dataclasses
import ipaddress
import json
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

import psycopg
import pytest
import pytest_asyncio
from aiohttp import web

from fluxora_webhooks import endpoints, enqueue, verify
from fluxora_webhooks.settings import Settings
from tests.support.dispatch import make_settings, rows, running_dispatcher, wait_until
from tests.support.receiver import Receiver

pytestmark = pytest.mark.integration

LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"),)
OPERATOR_SECRET = b"operator-secret-of-the-on-call-team-4242"


@pytest_asyncio.fixture
async def consumer() -> AsyncIterator[Receiver]:
    r = Receiver()
    await r.start()
    try:
        yield r
    finally:
        await r.stop()


@pytest_asyncio.fixture
async def operator() -> AsyncIterator[Receiver]:
    r = Receiver()
    await r.start()
    try:
        yield r
    finally:
        await r.stop()


def settings(operator: Receiver, **overrides: Any) -> Settings:
    return dataclasses.replace(
        make_settings("", allowed_networks=LOOPBACK),
        secret=b"",
        operator_url=operator.url,
        operator_secret=OPERATOR_SECRET,
        **overrides,
    )


async def send(database_url: str, n: int, tenant: str = "acme") -> None:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        for i in range(n):
            await enqueue(conn, tenant=tenant, stream_id=f"s{i}", event_type="x.y", payload={})


def notices(operator: Receiver, kind: str) -> list[dict[str, Any]]:
    """The operator's notices of one kind, each verified with the operator secret and free
    of the tenant endpoint's URL (its query carries a credential)."""
    found = []
    for r in operator.received:
        verify(r.body, r.headers, OPERATOR_SECRET)
        assert b"sekrit-query-token" not in r.body and b"127.0.0.1" not in r.body
        if r.headers["x-fluxora-event"] == kind:
            found.append(json.loads(r.body))
    return found


async def test_a_dead_letter_notice_says_when_the_delivery_died(
    database_url: str, consumer: Receiver, operator: Receiver
) -> None:
    consumer.respond = lambda r: web.Response(status=400)
    async with running_dispatcher(settings(operator), database_url):
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as c:
            ep, _ = await endpoints.create(
                c, tenant="acme", url=consumer.url, allowed_networks=LOOPBACK
            )
        await send(database_url, 2)
        await operator.wait_for(2)
    dead = dict(
        await rows(
            database_url,
            "SELECT delivery_id::text, dead_at FROM webhook_dead_letter WHERE endpoint_id = %s",
            (ep.id,),
        )
    )
    told = notices(operator, "delivery.dead_lettered")
    assert sorted(n["delivery_id"] for n in told) == sorted(dead)
    for n in told:
        assert n["endpoint_id"] == ep.id and n["tenant"] == "acme" and n["reason"] == "http_4xx"
        assert datetime.fromisoformat(n["dead_at"]) == dead[n["delivery_id"]]


async def test_a_removal_notice_says_when_each_delivery_died(
    database_url: str, consumer: Receiver, operator: Receiver
) -> None:
    async with running_dispatcher(settings(operator), database_url):
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as c:
            ep, _ = await endpoints.create(
                c, tenant="acme", url=consumer.url, allowed_networks=LOOPBACK
            )
            await endpoints.disable(c, ep.id)
            await send(database_url, 3)

            async def parked() -> bool:
                found = await rows(
                    database_url,
                    "SELECT count(*) FROM webhook_outbox WHERE endpoint_id = %s"
                    " AND hold = 'parked' AND NOT processed",
                    (ep.id,),
                )
                return found == [(3,)]

            await wait_until(parked, what="three parked deliveries")
            assert await endpoints.remove(c, ep.id) == 3
        await operator.wait_for(4, timeout=30)  # endpoint.disabled and three dead letters
    dead = dict(
        await rows(
            database_url,
            "SELECT delivery_id::text, dead_at FROM webhook_dead_letter WHERE endpoint_id = %s",
            (ep.id,),
        )
    )
    told = notices(operator, "delivery.dead_lettered")
    assert sorted(n["delivery_id"] for n in told) == sorted(dead)
    for n in told:
        assert n["reason"] == "endpoint_removed"
        assert datetime.fromisoformat(n["dead_at"]) == dead[n["delivery_id"]]


async def test_a_disabled_notice_says_since_when_the_endpoint_failed(
    database_url: str, consumer: Receiver, operator: Receiver
) -> None:
    consumer.respond = lambda r: web.Response(status=503)
    tuned = settings(operator, disable_after_ms=1000, retry_schedule_ms=(100,), max_attempts=50)
    async with (
        running_dispatcher(tuned, database_url),
        await psycopg.AsyncConnection.connect(database_url, autocommit=True) as c,
    ):
        ep, _ = await endpoints.create(
            c, tenant="acme", url=consumer.url, allowed_networks=LOOPBACK
        )
        await send(database_url, 1)
        await operator.wait_for(1, timeout=20)
        disabled = await endpoints.get(c, ep.id)
        consumer.respond = None
        await endpoints.enable(c, ep.id)
        await operator.wait_for(2)
    (off,) = notices(operator, "endpoint.disabled")
    (on,) = notices(operator, "endpoint.enabled")
    assert off["endpoint_id"] == ep.id and off["reason"] == "failing"
    assert disabled.failing_since is not None
    assert datetime.fromisoformat(off["failing_since"]) == disabled.failing_since
    assert on["endpoint_id"] == ep.id and on["failing_since"] is None
