"""An ordered endpoint's deliveries (SPEC 14) travel with the routing: a batch that routes
events sends an idle stream's delivery itself, and, in the room its own routed deliveries
leave, the ordered streams' heads that are due, claimed as the claim would."""

from __future__ import annotations

import asyncio
import ipaddress
import json
from typing import Any

import psycopg
import pytest
from aiohttp import web

from fluxora_webhooks import batch, endpoints, enqueue, partitions
from fluxora_webhooks.outbox import claim_due, promote_heads, route_events
from tests.integration.test_fanout import _settled, rejecting
from tests.support.dispatch import make_settings, rows, running_dispatcher, wait_until
from tests.support.receiver import Receiver

pytestmark = pytest.mark.integration

LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"),)


@pytest.mark.parametrize("partitioned", [False, True], ids=["plain", "partitioned"])
async def test_an_idle_streams_delivery_is_sent_by_the_batch_that_routes_it(
    database_url: str, partitioned: bool
) -> None:
    """One loop, one row per claim, one stream of three events: each event's routing batch
    finds the stream idle (the previous delivery was recorded by the batch before), so it
    makes the delivery due at once and sends it itself: each delivery is written once,
    by its event's transaction, never waiting."""
    receiver = Receiver()
    await receiver.start()
    try:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            if partitioned:
                assert await partitions.convert(conn, interval_ms=86_400_000) is True
            await endpoints.create(
                conn, url=receiver.url, tenant="acme", ordered=True, allowed_networks=LOOPBACK
            )
            async with conn.transaction():
                for n in (1, 2, 3):
                    await enqueue(
                        conn, tenant="acme", stream_id="s", event_type="e", payload={"n": n}
                    )
        settings = make_settings("", allowed_networks=LOOPBACK, claim_loops=1, batch_size=1)
        async with running_dispatcher(settings, database_url):
            await wait_until(lambda: _settled(database_url), what="all delivered")
        assert [json.loads(hit.body)["n"] for hit in receiver.received] == [1, 2, 3]
    finally:
        await receiver.stop()
    found = await rows(
        database_url,
        "SELECT xmin::text, (payload->>'n')::int, event_id IS NULL FROM webhook_outbox ORDER BY id",
    )
    by_txn: dict[str, set[tuple[int, bool]]] = {}
    for txn, n, is_event in found:
        by_txn.setdefault(txn, set()).add((n, is_event))
    together = sorted(sorted(v) for v in by_txn.values())
    assert together == [[(1, False), (1, True)], [(2, False), (2, True)], [(3, False), (3, True)]]


async def test_the_heads_a_routing_batch_takes_are_claimed_once(database_url: str) -> None:
    """The head this batch claimed itself is not taken a second time (its own lock does not
    make SKIP LOCKED skip it), and one locked by another batch is skipped."""
    receiver_url = "http://127.0.0.1:9/"
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        endpoint, _ = await endpoints.create(
            conn, url=receiver_url, tenant="acme", ordered=True, allowed_networks=LOOPBACK
        )
        # A head due now (as promote_heads leaves it), then an event of another stream.
        cur = await conn.execute(
            "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload, endpoint_id,"
            " event_id, stream_seq, created_at) VALUES ('acme', 'a', 'e', '{}', %s, 0, 0,"
            " now() - interval '1 second') RETURNING id",
            (endpoint.id,),
        )
        head = await cur.fetchone()
        assert head is not None
        await enqueue(conn, tenant="acme", stream_id="b", event_type="e", payload={})

    async def route(conn: psycopg.AsyncConnection[Any], claimed: list[int]) -> list[int]:
        claim = await claim_due(conn, 10)
        events = {r.id: r.partition_at for r in claim if r.is_event}
        routing = await route_events(conn, events, cap=10, heads=10, claimed=claimed)
        return [r.id for r in routing.due]

    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        mine = [r.id for r in await claim_due(conn, 10) if not r.is_event]
        assert mine == [head[0]]  # the claim took the head and the event
        await conn.rollback()
        async with conn.transaction():
            assert await route(conn, claimed=mine) == []  # not a second time
        async with conn.transaction():
            assert await route(conn, claimed=[]) == [head[0]]  # (what the exclusion prevents)
        async with (
            await psycopg.AsyncConnection.connect(database_url) as other,
            conn.transaction(),
        ):
            # Another batch holds the head: the routing skips it.
            await conn.execute("SELECT 1 FROM webhook_outbox WHERE id = %s FOR UPDATE", head)
            async with other.transaction():
                events = {r.id: r.partition_at for r in await claim_due(other, 10)}
                assert list(events) != []
                routing = await route_events(other, events, cap=10, heads=10)
                assert [r.id for r in routing.due] == []


async def test_a_head_recorded_again_after_a_rollback_is_followed_at_once(
    database_url: str,
) -> None:
    """The batch that sent a stream's head fails at its completion (a trigger rejects it
    once) and is recorded again row by row: the stream's next head is chosen there and
    then, not left for the periodic sweep (30 s, beyond this test's wait). The head and
    the delivery behind it were routed before (the head due, the next one waiting)."""
    receiver = Receiver()
    await receiver.start()
    try:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            await conn.execute("CREATE SEQUENCE reject_once")
            endpoint, _ = await endpoints.create(
                conn, url=receiver.url, tenant="acme", ordered=True, allowed_networks=LOOPBACK
            )
            await conn.execute(
                "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload,"
                " endpoint_id, event_id, stream_seq, hold, created_at) VALUES"
                " ('acme', 's', 'e', '{\"n\": 1}', %(e)s, 1, 1, NULL, now()),"
                " ('acme', 's', 'e', '{\"n\": 2}', %(e)s, 2, 2, 'waiting', 'infinity')",
                {"e": endpoint.id},
            )
        first = "NEW.processed AND NOT OLD.processed AND NEW.event_id IS NOT NULL"
        settings = make_settings("", allowed_networks=LOOPBACK, claim_loops=1)
        async with (
            rejecting(database_url, "UPDATE", first + " AND nextval('reject_once') = 1"),
            running_dispatcher(settings, database_url),
        ):
            await wait_until(lambda: _settled(database_url), what="both delivered")
        assert [json.loads(hit.body)["n"] for hit in receiver.received] == [1, 2]
    finally:
        await receiver.stop()


async def test_a_delivery_sent_by_a_routing_batch_that_rolls_back_is_sent_again_first(
    database_url: str,
) -> None:
    """An idle stream's first delivery is due as it is routed and sent by that batch; the
    batch's completion is rejected, so the delivery's row goes with the rollback. Its event
    is routed again (same delivery id) and the delivery sent again before the next one: a
    repeat, never a later event first, and without waiting for the sweep."""
    receiver = Receiver()
    await receiver.start()
    try:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            await conn.execute("CREATE SEQUENCE reject_once")
            await endpoints.create(
                conn, url=receiver.url, tenant="acme", ordered=True, allowed_networks=LOOPBACK
            )
            async with conn.transaction():
                for n in (1, 2):
                    await enqueue(
                        conn, tenant="acme", stream_id="s", event_type="e", payload={"n": n}
                    )
        first = "NEW.processed AND NOT OLD.processed AND NEW.event_id IS NOT NULL"
        # One event per batch: a stream with several events in one batch takes no lock.
        settings = make_settings("", allowed_networks=LOOPBACK, claim_loops=1, batch_size=1)
        async with (
            rejecting(database_url, "UPDATE", first + " AND nextval('reject_once') = 1"),
            running_dispatcher(settings, database_url),
        ):
            await wait_until(lambda: _settled(database_url), what="both delivered")
        hits = receiver.received
        assert [json.loads(hit.body)["n"] for hit in hits] == [1, 1, 2]
        assert len({hit.headers["webhook-id"] for hit in hits[:2]}) == 1, "the same delivery"
    finally:
        await receiver.stop()


@pytest.mark.parametrize("first", ["completion", "routing"])
async def test_a_next_head_is_chosen_with_what_the_locks_holder_committed(
    database_url: str, first: str
) -> None:
    """A completion (its stream's head delivered) and a routing (a new waiting delivery of
    the same stream) choose the stream's next head at the same time. Whichever comes second
    waits for the other's lock, then sees what it committed: the new delivery becomes the
    head exactly once. Chosen under the snapshot its statement began with, the second would
    still see the other's writes as not there, and neither would choose it."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        endpoint, _ = await endpoints.create(
            conn, url="http://127.0.0.1:9/", tenant="acme", ordered=True, allowed_networks=LOOPBACK
        )
        cur = await conn.execute(
            "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload, endpoint_id,"
            " event_id, stream_seq) VALUES ('acme', 's', 'e', '{}', %s, 0, 0) RETURNING id",
            (endpoint.id,),
        )
        head = await cur.fetchone()
        assert head is not None
    pair = [(endpoint.id, "s")]

    async def complete(conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.execute("UPDATE webhook_outbox SET processed = true WHERE id = %s", head)

    async def route(conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.execute(
            "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload, endpoint_id,"
            " event_id, stream_seq, hold, created_at) VALUES ('acme', 's', 'e', '{}', %s, 1, 1,"
            " 'waiting', 'infinity')",
            (endpoint.id,),
        )

    steps = {"completion": complete, "routing": route}
    second = "routing" if first == "completion" else "completion"
    async with (
        await psycopg.AsyncConnection.connect(database_url) as one,
        await psycopg.AsyncConnection.connect(database_url) as two,
    ):
        await steps[first](one)
        assert await promote_heads(one, pair) == 0  # the head in flight, or nothing waiting
        await steps[second](two)
        waiting = asyncio.create_task(promote_heads(two, pair))
        pid = two.info.backend_pid
        await wait_until(
            lambda: _waits_for_a_lock(database_url, pid), what="the second waits for the lock"
        )
        assert not waiting.done()
        await one.commit()
        assert await waiting == 1
        await two.commit()
    found = await rows(
        database_url,
        "SELECT stream_seq, processed, hold, created_at <= now()"
        " FROM webhook_outbox WHERE endpoint_id = %s ORDER BY stream_seq",
        (endpoint.id,),
    )
    assert found == [(0, True, None, True), (1, False, None, True)]


async def _waits_for_a_lock(database_url: str, pid: int) -> bool:
    found = await rows(
        database_url,
        "SELECT 1 FROM pg_locks WHERE pid = %s AND locktype = 'advisory' AND NOT granted",
        (pid,),
    )
    return bool(found)


async def _a_stream_and_a_gone_endpoint(
    database_url: str, receiver: Receiver
) -> tuple[endpoints.Endpoint, endpoints.Endpoint]:
    """Tenant acme's ordered endpoint with a stream of two (its head due, the next
    waiting) and another endpoint (answered 410 by the receiver: its header) with one
    delivery due."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        ordered, _ = await endpoints.create(
            conn, url=receiver.url, tenant="acme", ordered=True, allowed_networks=LOOPBACK
        )
        gone, _ = await endpoints.create(
            conn, url=receiver.url, tenant="acme", headers={"x-which": "gone"},
            allowed_networks=LOOPBACK,
        )  # fmt: skip
        await conn.execute(
            "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload,"
            " endpoint_id, event_id, stream_seq, hold, created_at) VALUES"
            " ('acme', 's', 'e', '{\"n\": 1}', %(o)s, 1, 1, NULL, now()),"
            " ('acme', 's', 'e', '{\"n\": 2}', %(o)s, 2, 2, 'waiting', 'infinity'),"
            " ('acme', 'g', 'e', '{\"n\": 0}', %(g)s, 3, NULL, NULL, now())",
            {"o": ordered.id, "g": gone.id},
        )
    return ordered, gone


async def _processed(database_url: str, endpoint_id: str, at_least: int) -> bool:
    got = await rows(
        database_url,
        "SELECT count(*) FROM webhook_outbox WHERE endpoint_id = %s AND processed",
        (endpoint_id,),
    )
    return bool(got[0][0] >= at_least)


async def test_a_disable_waits_for_a_held_endpoint_row_only_so_long(
    database_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another transaction holds the endpoint row a 410 must disable (an operator's edit
    left open). The batch's failure streak skips the held row rather than waiting for it;
    its recording lifted the session's lock timeout so its COMMIT never gives up (that
    would send the batch again), but the disable's own wait stays bounded
    (DISABLE_LOCK_TIMEOUT_MS, shortened here): it gives up, the batch commits with the
    stream's next head chosen, and nothing is sent twice."""
    monkeypatch.setattr(batch, "DISABLE_LOCK_TIMEOUT_MS", 300)
    receiver = Receiver()
    await receiver.start()
    receiver.respond = lambda r: web.Response(status=410 if r.headers.get("x-which") else 200)
    holder = await psycopg.AsyncConnection.connect(database_url)
    try:
        ordered, gone = await _a_stream_and_a_gone_endpoint(database_url, receiver)
        await holder.execute(  # an operator's edit, not committed yet
            "UPDATE webhook_endpoints SET description = 'editing' WHERE id = %s", (gone.id,)
        )
        settings = make_settings("", allowed_networks=LOOPBACK, claim_loops=1, max_attempts=5)

        async with running_dispatcher(settings, database_url):
            await wait_until(
                lambda: _processed(database_url, ordered.id, 2), what="the stream's two deliveries"
            )
        sent = [(json.loads(hit.body)["n"], hit.attempt) for hit in receiver.received]
    finally:
        await holder.rollback()
        await holder.close()
        await receiver.stop()
    # Each attempt once (the 410's again on the retry schedule, the endpoint not disabled):
    # no batch rolled back and sent again.
    assert sorted(set(sent)) == sorted(sent)
    assert {n for n, _ in sent} == {0, 1, 2}
    assert f"endpoint {gone.id}: disabling it failed (LockNotAvailable)" in caplog.text


@pytest.mark.parametrize(
    "sqlstate",
    [
        pytest.param("P0001", id="refused"),
        pytest.param("40P01", id="deadlock"),
        pytest.param("55P03", id="lock-timeout"),
        pytest.param("57014", id="statement-timeout"),
    ],
)
async def test_an_endpoint_the_database_will_not_disable_leaves_the_next_heads_chosen(
    database_url: str, caplog: pytest.LogCaptureFixture, sqlstate: str
) -> None:
    """One batch sends an ordered stream's head (delivered) and another endpoint's delivery
    (410 Gone: that endpoint is disabled at once). The database refuses the disable (a
    trigger raising an error, a deadlock, a lock or a statement timeout; the last three
    once rolled the whole batch back and claimed it again, without end): the stream's next
    head is still chosen by the batch, not left for the periodic sweep (30 s, beyond this
    test's wait), the endpoint stays enabled, and the 410's delivery is attempted again on
    the retry schedule rather than left parked, until it is a dead letter one attempt past
    WEBHOOK_MAX_ATTEMPTS."""
    receiver = Receiver()
    await receiver.start()
    receiver.respond = lambda r: web.Response(status=410 if r.headers.get("x-which") else 200)
    try:
        ordered, gone = await _a_stream_and_a_gone_endpoint(database_url, receiver)
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            await conn.execute(
                "CREATE FUNCTION refuse_disable() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
                f" IF NEW.state <> 'enabled' THEN RAISE EXCEPTION USING ERRCODE = '{sqlstate}';"
                " END IF;"
                " RETURN NEW; END $$"
            )
            await conn.execute(
                "CREATE TRIGGER refuse_disable BEFORE UPDATE ON webhook_endpoints"
                " FOR EACH ROW EXECUTE FUNCTION refuse_disable()"
            )
        settings = make_settings("", allowed_networks=LOOPBACK, claim_loops=1, max_attempts=2)

        async with running_dispatcher(settings, database_url):
            await wait_until(
                lambda: _processed(database_url, ordered.id, 2), what="the stream's two deliveries"
            )
            await wait_until(
                lambda: _processed(database_url, gone.id, 3), what="the 410's delivery again"
            )
        sent = [json.loads(hit.body)["n"] for hit in receiver.received]
        assert [n for n in sent if n] == [1, 2] and sent.count(0) == 3
    finally:
        await receiver.stop()
    assert await rows(
        database_url,
        "SELECT attempt, status_code, outcome FROM webhook_outbox"
        " WHERE endpoint_id = %s ORDER BY attempt",
        (gone.id,),
    ) == [(1, 410, "retry"), (2, 410, "retry"), (3, 410, "dead_letter")]
    assert await rows(
        database_url,
        "SELECT count(*) FROM webhook_outbox WHERE endpoint_id = %s AND hold = 'parked'",
        (gone.id,),
    ) == [(0,)]
    # The disable was tried, and refused, by the batch that chose the next head.
    assert f"endpoint {gone.id}: disabling it failed" in caplog.text
    assert await rows(
        database_url, "SELECT state FROM webhook_endpoints WHERE id = %s", (gone.id,)
    ) == [("enabled",)]
