"""An endpoint's life while a dispatcher runs (SPEC 10, 12, 13): changes reach it without a
restart; disabling parks deliveries and enabling sends them, nothing lost; 410 Gone and a
long failure streak disable it; the operator hears of it; removal dead-letters what was
pending; recovery re-queues dead letters; rotation signs with both secrets for a while."""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import json
import logging
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

import psycopg
import pytest
import pytest_asyncio
from aiohttp import web
from standardwebhooks import Webhook

from fluxora_webhooks import batch as batch_module
from fluxora_webhooks import deadletters, endpoints, enqueue, verify
from fluxora_webhooks import dispatcher as dispatcher_module
from fluxora_webhooks.dispatcher import Dispatcher
from fluxora_webhooks.errors import ConfigError, ConflictError, NotFoundError, VerificationError
from fluxora_webhooks.metrics import REGISTRY
from fluxora_webhooks.settings import Settings
from tests.support.dispatch import (
    SECRET,
    make_settings,
    rows,
    running_dispatcher,
    scalar,
    wait_until,
)
from tests.support.receiver import Receiver

pytestmark = pytest.mark.integration

LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"),)
OPERATOR_SECRET = b"operator-secret-that-is-long-enough-4242"


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


def settings(operator: Receiver | None = None, **overrides: Any) -> Settings:
    base = dataclasses.replace(
        make_settings("", allowed_networks=LOOPBACK), secret=b"", **overrides
    )
    if operator is not None:
        base = dataclasses.replace(base, operator_url=operator.url, operator_secret=OPERATOR_SECRET)
    return base


async def send(
    database_url: str, n: int, *, tenant: str = "", kind: str = "stream.updated"
) -> None:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        for i in range(n):
            await enqueue(conn, tenant=tenant, stream_id=f"s{i}", event_type=kind, payload={"i": i})


async def connect(database_url: str) -> psycopg.AsyncConnection[Any]:
    return await psycopg.AsyncConnection.connect(database_url, autocommit=True)


async def held(database_url: str, endpoint_id: str) -> int:
    return int(
        await scalar(
            database_url,
            "SELECT count(*) FROM webhook_outbox WHERE endpoint_id = %s AND NOT processed"
            " AND hold = 'parked'",
            (endpoint_id,),
        )
    )


async def test_live_add_disable_enable_update_without_a_restart(
    database_url: str, consumer: Receiver
) -> None:
    other = Receiver()
    await other.start()
    try:
        async with running_dispatcher(settings(), database_url):
            conn = await connect(database_url)
            async with conn:
                ep, _ = await endpoints.create(
                    conn, url=consumer.url, allowed_networks=LOOPBACK, headers={"X-Team": "blue"}
                )
                await send(database_url, 3)
                await consumer.wait_for(3)
                assert {r.headers["x-team"] for r in consumer.received} == {"blue"}

                await endpoints.disable(conn, ep.id)
                await send(database_url, 4)
                await wait_until(lambda: _eq(held(database_url, ep.id), 4), what="4 parked")
                await asyncio.sleep(0.3)
                assert len(consumer.received) == 3  # parked: not sent, kept, visible

                await endpoints.enable(conn, ep.id)
                await consumer.wait_for(7)

                await endpoints.update(
                    conn,
                    ep.id,
                    endpoints.Changes(url=other.url, event_types=["invoice.*"]),
                    allowed_networks=LOOPBACK,
                )
                await asyncio.sleep(0.3)  # the NOTIFY reaches the dispatcher's cache
                await send(database_url, 2, kind="invoice.paid")
                await send(database_url, 2, kind="stream.updated")
                await other.wait_for(2)
        assert len(consumer.received) == 7
        assert {r.headers["x-fluxora-event"] for r in other.received} == {"invoice.paid"}
        ids = [r.delivery_id for r in consumer.received]
        assert len(set(ids)) == 7  # nothing sent twice, nothing lost
    finally:
        await other.stop()


async def test_a_custom_header_a_consumer_echoes_back_is_stored_masked(
    database_url: str, consumer: Receiver
) -> None:
    """An endpoint's custom headers are sent as they are; a consumer that echoes them in its
    answer (an error page listing the request's headers) gets its credential masked in
    what is stored and shown (the attempt's response, the API, the dashboard), whole or as
    the token after its scheme; a short value ("blue") is no credential and stays."""
    consumer.respond = lambda r: web.Response(
        status=400,
        text=f"auth={r.headers['authorization']} token-again={r.headers['authorization'][7:]}"
        f" key={r.headers['x-api-key']} team={r.headers['x-team']}",
    )
    headers = {"Authorization": "Bearer HDRSECRET123", "X-Api-Key": "k3y-val-42", "X-Team": "blue"}
    async with running_dispatcher(settings(), database_url):
        conn = await connect(database_url)
        async with conn:
            await endpoints.create(
                conn, url=consumer.url, allowed_networks=LOOPBACK, headers=headers
            )
            await send(database_url, 1)
            await consumer.wait_for(1)
            await wait_until(
                lambda: _eq(
                    scalar(database_url, "SELECT count(*) FROM webhook_outbox WHERE processed"), 2
                ),
                what="routed, then the attempt recorded",
            )
    assert consumer.received[0].headers["authorization"] == "Bearer HDRSECRET123"
    stored = await rows(
        database_url, "SELECT response_body FROM webhook_outbox WHERE endpoint_id IS NOT NULL"
    )
    assert stored == [("auth=*** token-again=*** key=*** team=blue",)]


async def test_410_disables_at_once_and_parks_the_delivery_with_the_rest(
    database_url: str, consumer: Receiver, operator: Receiver
) -> None:
    consumer.respond = lambda r: web.Response(status=410)
    async with running_dispatcher(settings(operator), database_url):
        conn = await connect(database_url)
        async with conn:
            ep, _ = await endpoints.create(conn, url=consumer.url, allowed_networks=LOOPBACK)
            await send(database_url, 1)
            await consumer.wait_for(1)
            await wait_until(lambda: _state(database_url, ep.id, "disabled"), what="disabled")
            found = await endpoints.get(conn, ep.id)
            assert found.disabled_reason == "gone"
            # The 410 is recorded as an attempt; the delivery's next one is parked.
            gone_id = consumer.received[0].delivery_id
            assert await rows(
                database_url,
                "SELECT attempt, processed, outcome, status_code, hold FROM webhook_outbox"
                " WHERE delivery_id = %s ORDER BY attempt",
                (gone_id,),
            ) == [(1, True, "retry", 410, None), (2, False, None, None, "parked")]
            await send(database_url, 2)
            await wait_until(lambda: _eq(held(database_url, ep.id), 3), what="3 parked")
            assert len(consumer.received) == 1
            await operator.wait_for(1)
            consumer.respond = None
            await endpoints.enable(conn, ep.id)
            await consumer.wait_for(4)  # the gone one again, and the two parked
            await operator.wait_for(2)
    told = [json.loads(r.body) for r in operator.received]
    assert [r.headers["x-fluxora-event"] for r in operator.received] == [
        "endpoint.disabled",
        "endpoint.enabled",
    ]
    assert told[0]["endpoint_id"] == ep.id and told[0]["reason"] == "gone"
    for r in operator.received:
        assert verify(r.body, r.headers, OPERATOR_SECRET) == r.delivery_id
    assert len({r.delivery_id for r in consumer.received}) == 3
    again = [r.attempt for r in consumer.received if r.delivery_id == gone_id]
    assert again == [1, 2]  # the consumer never sees one attempt number twice


async def test_an_endpoint_gone_to_several_batches_at_once_is_disabled_counted_and_logged_once(
    database_url: str, consumer: Receiver, operator: Receiver, caplog: pytest.LogCaptureFixture
) -> None:
    """Twenty deliveries to an endpoint that answers 410 go out in batches at once: each
    batch's 410 disables it, but only the first does (one operator event, one increment of
    fluxora_webhook_endpoints_disabled_total, one warning); all twenty end parked."""
    caplog.set_level(logging.WARNING, logger="fluxora_webhooks")
    metric = ("fluxora_webhook_endpoints_disabled_total", {"reason": "gone"})
    before = REGISTRY.get_sample_value(*metric) or 0.0
    async with running_dispatcher(settings(operator), database_url):
        conn = await connect(database_url)
        async with conn:
            ep, _ = await endpoints.create(conn, url=consumer.url, allowed_networks=LOOPBACK)
            # Known to answer (its rows are no longer held back for its first answer), then
            # gone: twenty committed at once go out in batches together.
            await send(database_url, 1)
            await consumer.wait_for(1)
            consumer.respond = lambda r: web.Response(status=410)
            async with conn.transaction():
                for i in range(20):
                    await enqueue(conn, stream_id=f"g{i}", event_type="stream.updated", payload={})
            await wait_until(lambda: _eq(held(database_url, ep.id), 20), what="20 parked")
            await operator.wait_for(1)
            assert len(consumer.received) > 2  # more than one request met the 410
            await asyncio.sleep(0.3)
            _, changed = await endpoints.disable_once(conn, ep.id, reason="manual")
            assert not changed  # disabled already: nothing to count
    assert (REGISTRY.get_sample_value(*metric) or 0.0) - before == 1
    disabled = [r for r in caplog.records if f"endpoint {ep.id} disabled" in r.getMessage()]
    assert len(disabled) == 1
    assert len(operator.received) == 1


async def test_a_failure_streak_longer_than_disable_after_disables_it(
    database_url: str, consumer: Receiver, operator: Receiver
) -> None:
    consumer.respond = lambda r: web.Response(status=503)
    tuned = settings(operator, disable_after_ms=1000, retry_schedule_ms=(100,), max_attempts=50)
    async with running_dispatcher(tuned, database_url):
        conn = await connect(database_url)
        async with conn:
            ep, _ = await endpoints.create(conn, url=consumer.url, allowed_networks=LOOPBACK)
            await send(database_url, 2)
            await wait_until(
                lambda: _state(database_url, ep.id, "disabled"), timeout=20, what="disabled"
            )
            disabled = await endpoints.get(conn, ep.id)
            assert disabled.disabled_reason == "failing"
            streak = disabled.failing_since
            assert streak is not None and disabled.disabled_at is not None
            assert (disabled.disabled_at - streak).total_seconds() >= 1.0
            await wait_until(lambda: _eq(held(database_url, ep.id), 2), what="both parked")
            sent = len(consumer.received)
            await asyncio.sleep(0.5)
            assert len(consumer.received) == sent  # parked: no more attempts
            assert await scalar(database_url, "SELECT count(*) FROM webhook_dead_letter") == 0
            await operator.wait_for(1)
            assert json.loads(operator.received[0].body)["reason"] == "failing"
            consumer.respond = None
            await endpoints.enable(conn, ep.id)
            await wait_until(lambda: _delivered(database_url, ep.id, 2), what="delivered")
            assert (await endpoints.get(conn, ep.id)).failing_since is None


async def test_the_built_in_default_endpoint_keeps_the_first_waves_rules_when_failing(
    database_url: str, consumer: Receiver
) -> None:
    # SPEC 10: everything in sections 1-9 holds for it. A team upgrading from one
    # WEBHOOK_URL keeps retrying and dead-lettering, as before: its consumer is never
    # disabled behind its back with every new event parked until someone enables it.
    consumer.respond = lambda r: web.Response(status=503)
    tuned = dataclasses.replace(
        make_settings(consumer.url, allowed_networks=LOOPBACK),
        disable_after_ms=1000, retry_schedule_ms=(300,), max_attempts=6,
    )  # fmt: skip
    async with running_dispatcher(tuned, database_url):
        await send(database_url, 2)

        async def both_dead() -> bool:
            return bool(await scalar(database_url, "SELECT count(*) FROM webhook_dead_letter") == 2)

        await wait_until(both_dead, timeout=30, what="both dead-lettered")
        conn = await connect(database_url)
        async with conn:
            default = await endpoints.get(conn, "default")
        assert default.state == "enabled" and default.failing_since is not None
        assert await held(database_url, "default") == 0
        assert len(consumer.received) == 12  # six attempts each, the streak past a second


async def test_a_success_ends_the_streak_and_idle_time_alone_disables_nothing(
    database_url: str, consumer: Receiver
) -> None:
    answers = iter([503, 200, 503])
    consumer.respond = lambda r: web.Response(status=next(answers, 200))
    tuned = settings(disable_after_ms=1000, retry_schedule_ms=(100,))
    async with running_dispatcher(tuned, database_url):
        conn = await connect(database_url)
        async with conn:
            ep, _ = await endpoints.create(conn, url=consumer.url, allowed_networks=LOOPBACK)
            await send(database_url, 1)
            await wait_until(lambda: _delivered(database_url, ep.id, 1), what="delivered")
            assert (await endpoints.get(conn, ep.id)).failing_since is None
            await send(database_url, 1)  # 503: a new streak starts...
            await consumer.wait_for(3)
            await asyncio.sleep(1.5)  # ...and time passes without another failure
            assert (await endpoints.get(conn, ep.id)).enabled
            await wait_until(lambda: _delivered(database_url, ep.id, 2), what="delivered")


async def test_an_endpoint_disabled_right_after_start_up_is_told_to_the_operator(
    database_url: str, consumer: Receiver, operator: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The operator endpoint is in the registry once the dispatcher is ready: an operator
    event written at once is not skipped for want of it, however late the registry task
    (here: never) gets to its own first sync."""

    async def late(self: Dispatcher) -> None:
        await asyncio.Event().wait()

    monkeypatch.setattr(Dispatcher, "_housekeeping", late)
    async with running_dispatcher(settings(operator), database_url):
        conn = await connect(database_url)
        async with conn:
            ep, _ = await endpoints.create(conn, url=consumer.url, allowed_networks=LOOPBACK)
            await endpoints.disable(conn, ep.id)
        await operator.wait_for(1, timeout=30)
    assert [r.headers["x-fluxora-event"] for r in operator.received] == ["endpoint.disabled"]


async def test_a_start_without_the_variables_costs_the_running_dispatchers_nothing(
    database_url: str, consumer: Receiver, operator: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another dispatcher started without WEBHOOK_URL and WEBHOOK_OPERATOR_URL (a host
    missing them, a `run` from a shell) leaves the built-in endpoints alone while a running
    dispatcher configures them: removed and put back, the default tenant's events routed
    in between never reached `default`. A disabled built-in endpoint is never removed: its
    parked deliveries wait for enable."""
    monkeypatch.setattr(dispatcher_module, "HOUSEKEEPING_S", 0.2)
    # What the one without WEBHOOK_URL claims of `default`'s waits for the other one.
    monkeypatch.setattr(batch_module, "UNKNOWN_ENDPOINT_DEFER_MS", 300)
    configured = dataclasses.replace(settings(operator), webhook_url=consumer.url, secret=SECRET)
    async with running_dispatcher(configured, database_url):
        conn = await connect(database_url)
        async with conn:
            for builtin in (endpoints.DEFAULT_ID, endpoints.OPERATOR_ID):
                assert not await endpoints.sync_builtin(conn, builtin, None)  # the other's start
            assert await scalar(database_url, "SELECT count(*) FROM webhook_endpoints") == 2
            async with running_dispatcher(settings(), database_url):  # and a real one
                await send(database_url, 20)
                await consumer.wait_for(20)
            assert len({r.delivery_id for r in consumer.received}) == 20
            await endpoints.disable(conn, endpoints.DEFAULT_ID)
            await operator.wait_for(1)  # endpoint.disabled: the operator endpoint is there
            await send(database_url, 2)
            await wait_until(lambda: _eq(held(database_url, "default"), 2), what="2 parked")
            await _forget_seen(database_url)
            assert not await endpoints.sync_builtin(conn, endpoints.DEFAULT_ID, None)
            assert not (await endpoints.get(conn, endpoints.DEFAULT_ID)).enabled
            assert await held(database_url, "default") == 2
            await endpoints.enable(conn, endpoints.DEFAULT_ID)
            await consumer.wait_for(22)
            await operator.wait_for(2)
    assert [r.headers["x-fluxora-event"] for r in operator.received] == [
        "endpoint.disabled",
        "endpoint.enabled",
    ]
    assert len({r.delivery_id for r in consumer.received}) == 22


async def _forget_seen(database_url: str) -> None:
    """As if the last dispatcher configuring the built-in endpoints stopped long ago."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "UPDATE webhook_builtin_seen SET seen_at = now() - %s * interval '1 second'",
            (endpoints.BUILTIN_SEEN_S + 1,),
        )


async def test_a_built_in_endpoint_no_dispatcher_configures_any_more_is_removed(
    database_url: str, consumer: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """WEBHOOK_URL gone from every host: a dispatcher without it that starts once none that
    has it was seen for BUILTIN_SEEN_S removes `default` (the default tenant's events are
    then unrouted), and a dispatcher that has it puts it back. A running one never removes
    it, however long those that have it are away (a deploy, a crash loop)."""
    monkeypatch.setattr(dispatcher_module, "HOUSEKEEPING_S", 0.2)
    conn = await connect(database_url)
    async with conn:
        assert not await endpoints.sync_builtin(conn, endpoints.DEFAULT_ID, consumer.url)
        assert not await endpoints.sync_builtin(conn, endpoints.DEFAULT_ID, None)  # seen now
        await _forget_seen(database_url)
        assert await endpoints.sync_builtin(conn, endpoints.DEFAULT_ID, None)
        assert await scalar(database_url, "SELECT count(*) FROM webhook_endpoints") == 0
        configured = dataclasses.replace(settings(), webhook_url=consumer.url, secret=SECRET)
        async with running_dispatcher(configured, database_url):
            await wait_until(
                lambda: _eq(scalar(database_url, "SELECT count(*) FROM webhook_endpoints"), 1),
                what="default put back",
            )
        async with running_dispatcher(settings(), database_url):  # the variable gone
            await asyncio.sleep(0.5)
            assert (await endpoints.get(conn, endpoints.DEFAULT_ID)).enabled  # seen lately
            await _forget_seen(database_url)
            await asyncio.sleep(1.0)  # five housekeeping periods
            assert (await endpoints.get(conn, endpoints.DEFAULT_ID)).enabled
        async with running_dispatcher(settings(), database_url):  # started after a minute
            assert await scalar(database_url, "SELECT count(*) FROM webhook_endpoints") == 0


async def test_a_dispatcher_without_webhook_url_leaves_the_default_endpoints_events_waiting(
    database_url: str, consumer: Receiver, operator: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host without WEBHOOK_URL beside one that has it (the registry has the built-in
    default endpoint): the default tenant's events it claims become that endpoint's
    deliveries and wait for a dispatcher that can send them, never marked routed and
    lost; the default tenant's registered endpoint gets each event once all the same."""
    monkeypatch.setattr(batch_module, "UNKNOWN_ENDPOINT_DEFER_MS", 300)
    async with running_dispatcher(settings(), database_url):
        conn = await connect(database_url)
        async with conn:
            # What the configured host's start (or its restore) writes; this one's start
            # removed it.
            await endpoints.sync_builtin(conn, endpoints.DEFAULT_ID, consumer.url)
            await endpoints.create(conn, url=operator.url, allowed_networks=LOOPBACK)
        await send(database_url, 10)
        await operator.wait_for(10)  # the registered endpoint's deliveries: sent here

        async def waiting() -> bool:
            found = await rows(
                database_url,
                "SELECT count(*) FILTER (WHERE endpoint_id = 'default' AND NOT processed),"
                " count(*) FILTER (WHERE processed AND outcome = 'unrouted')"
                " FROM webhook_outbox WHERE event_id IS NULL",
            )
            return found == [(10, 0)]

        await wait_until(waiting, what="ten events waiting as the default's deliveries")
        assert consumer.received == []
    configured = dataclasses.replace(settings(), webhook_url=consumer.url, secret=SECRET)
    async with running_dispatcher(configured, database_url):
        await consumer.wait_for(10)
    assert len({r.delivery_id for r in consumer.received}) == 10
    assert len({r.delivery_id for r in operator.received}) == len(operator.received) == 10
    assert (
        await scalar(database_url, "SELECT count(*) FROM webhook_outbox WHERE outcome = 'unrouted'")
        == 0
    )


async def test_removal_dead_letters_pending_deliveries_and_tells_the_operator(
    database_url: str, consumer: Receiver, operator: Receiver
) -> None:
    async with running_dispatcher(settings(operator), database_url):
        conn = await connect(database_url)
        async with conn:
            ep, _ = await endpoints.create(conn, url=consumer.url, allowed_networks=LOOPBACK)
            await endpoints.disable(conn, ep.id)
            await send(database_url, 5)
            await wait_until(lambda: _eq(held(database_url, ep.id), 5), what="parked")
            assert await endpoints.remove(conn, ep.id) == 5
            with pytest.raises(NotFoundError):
                await endpoints.get(conn, ep.id)
            # endpoint.disabled + five dead letters (a generous wait: beside the suite's
            # million-row tests the database can be slow for seconds)
            await operator.wait_for(6, timeout=30)
    reasons = await rows(
        database_url,
        "SELECT reason, count(*) FROM webhook_dead_letter WHERE endpoint_id = %s GROUP BY 1",
        (ep.id,),
    )
    assert reasons == [("endpoint_removed", 5)]
    kinds = sorted(r.headers["x-fluxora-event"] for r in operator.received)
    assert kinds == ["delivery.dead_lettered"] * 5 + ["endpoint.disabled"]
    assert consumer.received == []


async def test_recover_requeues_ten_thousand_dead_letters_in_one_call(
    database_url: str, consumer: Receiver
) -> None:
    conn = await connect(database_url)
    async with conn:
        ep, _ = await endpoints.create(conn, url=consumer.url, allowed_networks=LOOPBACK)
        await conn.execute(
            "INSERT INTO webhook_dead_letter (delivery_id, stream_id, event_type, payload,"
            " attempts, reason, enqueued_at, dead_at, endpoint_id)"
            " SELECT gen_random_uuid(), 's' || g, 'stream.updated', jsonb_build_object('g', g),"
            " 8, 'attempts_exhausted', now(), now() - interval '30 minutes', %s"
            " FROM generate_series(1, 10000) g",
            (ep.id,),
        )
        await conn.execute(  # outside the window: stays
            "INSERT INTO webhook_dead_letter (delivery_id, stream_id, event_type, payload,"
            " attempts, reason, enqueued_at, dead_at, endpoint_id) VALUES (gen_random_uuid(),"
            " 'old', 'stream.updated', '{}', 8, 'attempts_exhausted', now(),"
            " now() - interval '3 days', %s)",
            (ep.id,),
        )
        since = await endpoints.moment(conn, "2h", "--since")
        assert await endpoints.recover(conn, ep.id, since=since) == 10_000
        assert await endpoints.recover(conn, ep.id, since=since) == 0  # once only
    same = await scalar(
        database_url,
        "SELECT count(*) FROM webhook_outbox o JOIN webhook_dead_letter d"
        " ON d.delivery_id = o.delivery_id WHERE o.endpoint_id = %s AND o.attempt = 1"
        " AND o.replay AND NOT o.processed AND d.state = 'replayed'",
        (ep.id,),
    )
    assert same == 10_000
    assert (
        await scalar(database_url, "SELECT count(*) FROM webhook_dead_letter WHERE state = 'dead'")
        == 1
    )
    # Due one after another at the rate the gate admits them (WEBHOOK_RETRY_RPS, 10 a
    # second), across the batches of the one call: all due at once, each was refused and
    # claimed again every second, ahead of every other endpoint's deliveries, for the
    # quarter of an hour the last one waited.
    ((spread, due_times, first_in),) = await rows(
        database_url,
        "SELECT EXTRACT(EPOCH FROM max(created_at) - min(created_at)),"
        " count(DISTINCT created_at), EXTRACT(EPOCH FROM min(created_at) - now())"
        " FROM webhook_outbox WHERE endpoint_id = %s",
        (ep.id,),
    )
    # 9,999 gaps of a tenth of a second (each batch's transaction starts a moment later).
    assert 999.9 <= float(spread) < 1010 and due_times == 10_000
    assert float(first_in) < 1


async def test_enabling_makes_parked_retries_due_at_the_endpoints_rate(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WEBHOOK_RETRY_RPS", "4")
    conn = await connect(database_url)
    async with conn:
        ep, _ = await endpoints.create(conn, url="https://parked.example.com/", tenant="t")
        await endpoints.disable(conn, ep.id)
        await conn.execute(  # a failing streak's retries, and first attempts, all parked
            "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload, endpoint_id,"
            " attempt, hold, created_at)"
            " SELECT 't', 's', 'e', '{}', %s, CASE WHEN g <= 20 THEN 3 ELSE 1 END,"
            " 'parked', 'infinity' FROM generate_series(1, 25) g",
            (ep.id,),
        )
        await endpoints.enable(conn, ep.id)
    due = dict(
        await rows(
            database_url,
            "SELECT attempt, round(EXTRACT(EPOCH FROM max(created_at) - min(created_at)), 2)"
            " FROM webhook_outbox WHERE endpoint_id = %s GROUP BY attempt",
            (ep.id,),
        )
    )
    # The retries one after another at 4 a second (19 gaps); the first attempts at once.
    assert {k: float(v) for k, v in due.items()} == {3: 4.75, 1: 0.0}


async def test_replayed_dead_letters_are_due_at_each_endpoints_rate(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WEBHOOK_RETRY_RPS", "4")
    conn = await connect(database_url)
    async with conn:
        fast, _ = await endpoints.create(
            conn, url="https://fast.example.com/", tenant="t", rate_limit=50
        )
        plain, _ = await endpoints.create(conn, url="https://plain.example.com/", tenant="t")
        await conn.execute(
            "INSERT INTO webhook_dead_letter (delivery_id, tenant, stream_id, event_type,"
            " payload, attempts, reason, enqueued_at, dead_at, endpoint_id)"
            " SELECT gen_random_uuid(), 't', 's', 'e', '{}', 8, 'attempts_exhausted', now(),"
            " now() - g * interval '1 second', e"
            " FROM generate_series(1, 20) g, unnest(ARRAY[%s, %s]) e",
            (fast.id, plain.id),
        )
    assert len(await deadletters.replay(database_url, [], include_all=True)) == 40
    spreads = dict(
        await rows(
            database_url,
            "SELECT endpoint_id, round(EXTRACT(EPOCH FROM max(created_at) - min(created_at)), 2)"
            " FROM webhook_outbox GROUP BY endpoint_id",
        )
    )
    # 19 gaps of 1/50 s and of 1/4 s (WEBHOOK_RETRY_RPS for an endpoint without its own).
    assert {k: float(v) for k, v in spreads.items()} == {fast.id: 0.38, plain.id: 4.75}


async def test_rotation_signs_with_both_secrets_until_the_overlap_ends(
    database_url: str, consumer: Receiver
) -> None:
    async with running_dispatcher(settings(), database_url) as dispatcher:

        async def signing_with(endpoint_id: str, secrets: int) -> bool:
            target = dispatcher.targets.get(endpoint_id)
            return target is not None and target.signer.secrets == secrets

        conn = await connect(database_url)
        async with conn:
            ep, old = await endpoints.create(conn, url=consumer.url, allowed_networks=LOOPBACK)
            _, new = await endpoints.rotate_secret(conn, ep.id)
            # The change reaches the running dispatcher (NOTIFY, then a reload).
            await wait_until(lambda: signing_with(ep.id, 2), what="the rotation")
            await send(database_url, 1)
            await consumer.wait_for(1)
            _, newest = await endpoints.rotate_secret(conn, ep.id, keep_previous_ms=0)
            await wait_until(lambda: signing_with(ep.id, 1), what="the overlap's end")
            await send(database_url, 1)
            await consumer.wait_for(2)
    during, after = consumer.received
    assert len(during.headers["webhook-signature"].split()) == 2
    for secret in (old, new):
        Webhook(secret).verify(during.body, during.headers)
    assert verify(during.body, during.headers, new, scheme="fluxora") == during.delivery_id
    with pytest.raises(VerificationError):
        verify(during.body, during.headers, old, scheme="fluxora")
    assert len(after.headers["webhook-signature"].split()) == 1
    Webhook(newest).verify(after.body, after.headers)


async def test_bad_registrations_are_refused_naming_the_field(database_url: str) -> None:
    conn = await connect(database_url)
    async with conn:
        for kwargs, field in (
            ({"url": "http://example.com/hook"}, "url"),
            ({"url": "https://127.0.0.1/hook"}, "url"),  # loopback not allowed here
            ({"url": "http://localhost:9/hook"}, "url"),
            ({"url": "https://10.0.0.5/hook"}, "url"),
            ({"url": "https://ok.example.com/", "headers": {"Content-Type": "x"}}, "headers"),
            ({"url": "https://ok.example.com/", "headers": {"x-fluxora-event": "x"}}, "headers"),
            ({"url": "https://ok.example.com/", "headers": {"webhook-id": "x"}}, "headers"),
            # A hop's or the body's: HTTP decides them (a stored row keeps working).
            ({"url": "https://ok.example.com/", "headers": {"Upgrade": "h2c"}}, "headers"),
            (
                {"url": "https://ok.example.com/", "headers": {"content-encoding": "gzip"}},
                "headers",
            ),
            ({"url": "https://ok.example.com/", "headers": {"Keep-Alive": "5"}}, "headers"),
            # Each value allowed, 12 KiB in all: many servers would refuse every request.
            (
                {
                    "url": "https://ok.example.com/",
                    "headers": {f"X-Part-{i}": "v" * 4000 for i in range(3)},
                },
                "headers",
            ),
            ({"url": "https://ok.example.com/", "event_types": []}, "event_types"),
            ({"url": "https://ok.example.com/", "event_types": ["a b"]}, "event_types"),
            ({"url": "https://ok.example.com/", "secret": "short"}, "secret"),
            ({"url": "https://ok.example.com/", "secret": "whsec_"}, "secret"),
            # A no-break space inside, which reads as a space when the secret is copied.
            (
                {"url": "https://ok.example.com/", "secret": "abcdefghijkl\u00a0mnopqrstuvwxyz"},
                "secret",
            ),
            ({"url": "https://ok.example.com/" + "a" * 8000}, "url"),
            ({"url": "https://ok.example.com/", "tenant": "bad tenant"}, "tenant"),
            ({"url": "https://ok.example.com/", "rate_limit": 0}, "rate_limit"),
            # A name and its value written as one (a colon, a space): only the name is shown.
            ({"url": "https://ok.example.com/", "headers": {"Auth: Basic c2Vj==": "v"}}, "headers"),
        ):
            with pytest.raises(ConfigError) as caught:
                await endpoints.create(conn, **kwargs)
            assert caught.value.variable == field, kwargs
            assert "c2Vj" not in str(caught.value)
        # The refusal says why a name cut at its space is no name, not that its head is not.
        with pytest.raises(ConfigError) as caught:
            endpoints.check_headers({"X-Foo Bar": "v"})
        assert "'X-Foo...' is not a header name: a name holds no space or colon" in str(
            caught.value
        )
        assert await scalar(database_url, "SELECT count(*) FROM webhook_endpoints") == 0
        made, _ = await endpoints.create(conn, url="https://ok.example.com/")
        with pytest.raises(ConfigError, match="Expect is for a connection's hop"):
            await endpoints.update(conn, made.id, endpoints.Changes(headers={"Expect": "x"}))
        # Read from a stored row (written before the rule), such a header is sent.
        assert endpoints.check_headers({"Keep-Alive": "5"}) == {"Keep-Alive": "5"}
        large = {f"X-Part-{i}": "v" * 4000 for i in range(3)}
        assert endpoints.check_headers(large) == large
        with pytest.raises(ConfigError, match="come to 12036 bytes; at most 8192 in all"):
            await endpoints.update(conn, made.id, endpoints.Changes(headers=large))
        two = {f"X-Part-{i}": "v" * 4000 for i in range(2)}
        updated = await endpoints.update(conn, made.id, endpoints.Changes(headers=two))
        assert updated.headers == two
        await endpoints.remove(conn, made.id)
        await endpoints.sync_builtin(conn, endpoints.DEFAULT_ID, "https://hooks.example.com/")
        with pytest.raises(ConflictError):
            await endpoints.update(conn, "default", endpoints.Changes(description="x"))
        with pytest.raises(ConflictError):
            await endpoints.remove(conn, "default")
        # The built-in endpoints' secrets come from the environment: the refusal says
        # which variables rotate each.
        await endpoints.sync_builtin(conn, endpoints.OPERATOR_ID, "https://ops.example.com/")
        with pytest.raises(ConflictError, match="WEBHOOK_SECRET_PREVIOUS"):
            await endpoints.rotate_secret(conn, "default")
        with pytest.raises(ConflictError, match="WEBHOOK_OPERATOR_SECRET") as refused:
            await endpoints.rotate_secret(conn, "operator")
        assert "PREVIOUS" not in str(refused.value)


async def test_tenant_scoping_hides_other_tenants_endpoints(database_url: str) -> None:
    conn = await connect(database_url)
    async with conn:
        mine, _ = await endpoints.create(conn, url="https://a.example.com/", tenant="acme")
        theirs, _ = await endpoints.create(conn, url="https://b.example.com/", tenant="bolt")
        assert [e.id for e in await endpoints.list_endpoints(conn, tenant="acme")] == [mine.id]
        for call in (
            endpoints.get(conn, theirs.id, tenant="acme"),
            endpoints.disable(conn, theirs.id, tenant="acme"),
            endpoints.remove(conn, theirs.id, tenant="acme"),
        ):
            with pytest.raises(NotFoundError):
                await call
        assert (await endpoints.get(conn, theirs.id)).enabled


# -- what the operator's alerting reads: each notice signed, saying when it happened (a
# dead letter's dead_at, a disabled endpoint's failing_since: retries of the notice itself
# send it later), and carrying no tenant's URL or secret.


def _notices(operator: Receiver, kind: str) -> list[dict[str, Any]]:
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
        await send(database_url, 2, tenant="acme")
        await operator.wait_for(2)
    dead = await _dead_at(database_url, ep.id)
    told = _notices(operator, "delivery.dead_lettered")
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
            await send(database_url, 3, tenant="acme")

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
    dead = await _dead_at(database_url, ep.id)
    told = _notices(operator, "delivery.dead_lettered")
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
        await send(database_url, 1, tenant="acme")
        await operator.wait_for(1, timeout=20)
        disabled = await endpoints.get(c, ep.id)
        consumer.respond = None
        await endpoints.enable(c, ep.id)
        await operator.wait_for(2)
    (off,) = _notices(operator, "endpoint.disabled")
    (on,) = _notices(operator, "endpoint.enabled")
    assert off["endpoint_id"] == ep.id and off["reason"] == "failing"
    assert disabled.failing_since is not None
    assert datetime.fromisoformat(off["failing_since"]) == disabled.failing_since
    assert on["endpoint_id"] == ep.id and on["failing_since"] is None


async def _eq(value: Any, wanted: int) -> bool:
    return bool(await value == wanted)


async def _state(database_url: str, endpoint_id: str, state: str) -> bool:
    found = await scalar(
        database_url, "SELECT state FROM webhook_endpoints WHERE id = %s", (endpoint_id,)
    )
    return bool(found == state)


async def _delivered(database_url: str, endpoint_id: str, n: int) -> bool:
    found = await scalar(
        database_url,
        "SELECT count(*) FROM webhook_outbox WHERE endpoint_id = %s AND outcome = 'delivered'",
        (endpoint_id,),
    )
    return int(found) == n


async def _dead_at(database_url: str, endpoint_id: str) -> dict[str, Any]:
    """When each dead letter of the endpoint died, by delivery id."""
    return dict(
        await rows(
            database_url,
            "SELECT delivery_id::text, dead_at FROM webhook_dead_letter WHERE endpoint_id = %s",
            (endpoint_id,),
        )
    )
