"""An outage of this service's DNS resolver is this service's trouble, not its consumers':
once lookups of names that resolved before fail for two of them, the deliveries that need
a lookup are held with their attempts unused (counted against no endpoint, said on the
delivery and by ``status``), lookups are tried again one at a time, and the first answer
makes the held deliveries due at once. A lookup that fails before that is counted as any
failed attempt: one name's own servers failing is its endpoint's trouble."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from typing import Any

import psycopg
import pytest
import trustme
from aiohttp.abc import AbstractResolver, ResolveResult

from fluxora_webhooks import endpoints, enqueue
from fluxora_webhooks.connector import SafeResolver
from fluxora_webhooks.delivery import RESOLVER, RESOLVER_HELD, AttemptResult, attempt
from fluxora_webhooks.dispatcher import Dispatcher
from fluxora_webhooks.httpclient import HttpClient
from fluxora_webhooks.ops import read_egress_held
from fluxora_webhooks.retry import Kind
from tests.support.api import LOOPBACK
from tests.support.dispatch import make_settings, rows, wait_until
from tests.support.procs import free_port
from tests.support.resolvers import answer
from tests.support.tls_consumer import TlsConsumer

pytestmark = pytest.mark.integration

NAMES = ("hooks.alpha.test", "hooks.beta.test")  # two zones (egress.zone)


class SwitchedResolver(AbstractResolver):
    """Every name is 127.0.0.1 while ``up``; else each lookup fails as glibc's does when
    its name servers cannot be reached ("Temporary failure in name resolution"), or, with
    ``hang``, gets no answer at all (their packets dropped)."""

    def __init__(self, *, hang: bool = False) -> None:
        self.up = True
        self.hang = hang
        self.lookups: list[tuple[str, bool]] = []

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        self.lookups.append((host, self.up))
        if not self.up:
            if self.hang:
                await asyncio.sleep(60)
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return answer(host, port, ["127.0.0.1"])

    async def close(self) -> None:
        return None


async def _send(database_url: str, *event_types: str) -> None:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        for i, event_type in enumerate(event_types):
            await enqueue(
                conn, tenant="acme", stream_id=f"s{i}", event_type=event_type, payload={"i": i}
            )


async def _by_type(database_url: str) -> dict[str, list[tuple[Any, ...]]]:
    """Each delivery's rows (attempt, processed, outcome, error, due later), by event type."""
    found: dict[str, list[tuple[Any, ...]]] = {}
    for event_type, *row in await rows(
        database_url,
        "SELECT event_type, attempt, processed, outcome, error, created_at > now()"
        " FROM webhook_outbox WHERE endpoint_id IS NOT NULL ORDER BY id",
    ):
        found.setdefault(event_type, []).append(tuple(row))
    return found


async def test_a_resolver_outage_holds_deliveries_with_their_attempts_unused(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "fluxora_webhooks")
    ca = trustme.CA()
    with TlsConsumer(ca.issue_cert(*NAMES)) as consumer:
        switched = SwitchedResolver()
        context = ssl.create_default_context()
        ca.configure_trust(context)
        client = HttpClient(SafeResolver(True, resolver=switched), ssl_context=context)
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            alpha, _ = await endpoints.create(
                conn, url=consumer.url(NAMES[0]), tenant="acme", event_types=("a.*",),
                allowed_networks=LOOPBACK,
            )  # fmt: skip
            beta, _ = await endpoints.create(
                conn, url=consumer.url(NAMES[1]), tenant="acme", event_types=("b.*",),
                allowed_networks=LOOPBACK,
            )  # fmt: skip
        # A failed attempt's retry comes a minute later: after this test.
        settings = make_settings("", allowed_networks=LOOPBACK, retry_schedule_ms=(60_000,))
        dispatcher = Dispatcher(settings, conninfo=database_url, client=client)
        task = asyncio.create_task(dispatcher.run())
        try:
            await dispatcher.ready.wait()

            async def received(n: int) -> bool:
                return len(consumer.requests) >= n

            # Both names resolve, and are remembered as names that do.
            await _send(database_url, "a.first", "b.first")

            async def first_recorded() -> bool:  # their connections are back in the pool
                found = await _by_type(database_url)
                return all(
                    [r[2] for r in found.get(t, [])] == ["delivered"]
                    for t in ("a.first", "b.first")
                )

            await wait_until(first_recorded, 30, "the first two delivered")

            switched.up = False
            # Cached answers and open connections go on working; new ones need lookups.
            client.clear_dns_cache()
            client.close_idle()
            # One name's lookup fails: as far as anyone can tell, its own servers fail.
            await _send(database_url, "a.failed")

            async def decided(event_type: str, n: int) -> bool:
                return len((await _by_type(database_url)).get(event_type, [])) >= n

            await wait_until(lambda: decided("a.failed", 2), 30, "a.failed's retry row")
            # A second name's fails too, with none answered since: the resolver fails.
            await _send(database_url, "b.held")

            async def held(event_type: str) -> bool:
                found = (await _by_type(database_url)).get(event_type, [])
                return [r[3] for r in found] == [RESOLVER_HELD]

            await wait_until(lambda: held("b.held"), 30, "b.held held")
            looked_up = len(switched.lookups)
            await _send(database_url, "a.held", "b.held2")
            for event_type in ("a.held", "b.held2"):
                await wait_until(lambda t=event_type: held(t), 30, f"{event_type} held")  # type: ignore[misc]
            # Held without a lookup each: at most the one probe every few seconds.
            assert len(switched.lookups) - looked_up <= 2, switched.lookups
            state = await _by_type(database_url)
            # The failure before the outage was seen counts against its endpoint; the held
            # ones use no attempt (one row each, attempt 1, not processed, due later).
            assert [r[:3] for r in state["a.failed"]] == [(1, True, "retry"), (2, False, None)]
            for event_type in ("b.held", "a.held", "b.held2"):
                assert state[event_type] == [(1, False, None, RESOLVER_HELD, True)], state
            endpoint_state = await rows(
                database_url,
                "SELECT id, failing_since IS NOT NULL FROM webhook_endpoints WHERE id IN (%s, %s)",
                (alpha.id, beta.id),
            )
            assert dict(endpoint_state) == {alpha.id: True, beta.id: False}
            async with await psycopg.AsyncConnection.connect(database_url) as conn:
                assert await read_egress_held(conn, 1000) == 3  # what status counts

            # Lookups answer again: the next probe ends the outage and the held deliveries
            # are due at once (not at the end of their holds).
            switched.up = True
            await wait_until(lambda: received(5), 30, "the held three delivered")
        finally:
            dispatcher.stop()
            await asyncio.wait_for(task, 30)
            await client.close()
    state = await _by_type(database_url)
    for event_type in ("b.held", "a.held", "b.held2"):
        assert [(r[0], r[1], r[2]) for r in state[event_type]] == [(1, True, "delivered")]
    hosts = sorted(r.headers.get("host", "").split(":")[0] for r in consumer.requests)
    assert hosts == sorted([NAMES[0], NAMES[1], NAMES[1], NAMES[0], NAMES[1]]), hosts
    said = caplog.text
    assert "DNS lookups fail on this machine" in said, said
    assert "DNS lookups work again" in said and "this process held are due now" in said, said


async def test_lookups_that_get_no_answer_within_the_requests_timeout_are_a_sign_too() -> None:
    """A resolver whose packets are dropped answers nothing: with a request timeout under
    the lookup's own (5 s), the request's time runs out in the lookup, which is as much a
    sign as the resolver's own timeout."""
    switched = SwitchedResolver(hang=True)
    client = HttpClient(SafeResolver(True, resolver=switched))
    port = free_port()  # nothing listens: a lookup that answers ends in a refusal

    async def post(name: str) -> AttemptResult:
        return await attempt(
            client, f"http://{name}:{port}/hook", b"{}", {"content-type": "application/json"},
            timeout_s=0.3, max_response_bytes=1024,
        )  # fmt: skip

    try:
        names = ("hooks.alpha.test", "hooks.beta.test", "hooks.gamma.test")
        for name in names:  # resolved, and remembered as names that do
            assert (await post(name)).reason == "connection_error"
        switched.up = False
        client.clear_dns_cache()
        first = await post(names[0])  # one zone: its endpoint's own timeout, maybe
        assert (first.kind, first.reason) == (Kind.RETRYABLE, "timeout"), first
        second = await post(names[1])  # a second zone: the resolver
        assert second.reason == RESOLVER and "no answer within the timeout" in (
            second.error or ""
        ), second
        asked = len(switched.lookups)
        third = await post(names[2])  # held: not looked up
        assert third.reason == RESOLVER and "held" in (third.error or ""), third
        assert len(switched.lookups) == asked
    finally:
        await client.close()
