"""SIGTERM during busy batches: every claim loop has a full batch in flight, mixing slow
successes, requests the consumer never answers (they time out), 503s and 410s. Requests that
outlive their batch go on under a lease (SPEC 11) while the loops claim more. The process
exits 0 within the bound (request timeout + 5 s); every attempt that was in flight is
recorded with the outcome SPEC section 4 names; nothing was recorded unsent; and a second
dispatcher delivers the rest: nothing is lost."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import psycopg
import pytest

from tests.support.chaos import (
    Behaviour,
    ChaosConsumer,
    Hit,
    account,
    enqueue_events,
    stop_processes,
    tracebacks,
)
from tests.support.dispatch import pending, rows, scalar, wait_until
from tests.support.procs import DispatcherProcess, dispatcher_env, start_dispatcher

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TIMEOUT_S = 3
DRAIN_GRACE_S = 5
ABANDONED = "abandoning the in-flight batch"  # the service's log line when the bound is hit
LOOPS, BATCH = 4, 20
# First attempts: (behaviour, the outcome recorded for it, its error).
FIRST = {
    "slow-ok": (Behaviour.SLOW, "delivered", None),  # answers 200 after 2 s: in time
    "silent": (Behaviour.SILENT, "retry", "timeout"),  # never answers: times out
    "retry": (Behaviour.RETRY, "retry", "HTTP 503"),
    "gone": (Behaviour.GONE, "dead_letter", "HTTP 410"),
    "ok": (Behaviour.OK, "delivered", None),
}


async def test_sigterm_during_a_busy_batch(
    database_url: str, redis_url: str, redis_prefix: str, tmp_path: Path
) -> None:
    def choose(hit: Hit) -> Behaviour:
        assert hit.kind is not None
        return FIRST[hit.kind][0] if hit.attempt == 1 else Behaviour.OK

    consumer = ChaosConsumer(choose, slow_s=2.0)
    await consumer.start()
    env = dispatcher_env(
        database_url, redis_url, consumer.url, redis_prefix,
        WEBHOOK_TIMEOUT_MS=str(TIMEOUT_S * 1000), WEBHOOK_BATCH_SIZE=str(BATCH),
        WEBHOOK_CLAIM_LOOPS=str(LOOPS), WEBHOOK_RETRY_SCHEDULE="100ms",
        WEBHOOK_MAX_ATTEMPTS="3", WEBHOOK_RETRY_RPS="1000",
    )  # fmt: skip
    kinds = [kind for _ in range(60) for kind in FIRST]  # 300 events, kinds interleaved
    procs: list[DispatcherProcess] = []
    try:
        proc = await start_dispatcher(env, tmp_path / "first.log")
        procs.append(proc)
        await enqueue_events(database_url, kinds)
        await consumer.wait_for(LOOPS * BATCH)  # every loop has a full batch in flight
        in_flight = len(consumer.hits)
        started = time.monotonic()
        [code] = await stop_processes([proc], TIMEOUT_S + DRAIN_GRACE_S + 10)
        took = time.monotonic() - started
        first_hits = list(consumer.hits)
        log = proc.log()
        assert code == 0, log
        assert took <= TIMEOUT_S + DRAIN_GRACE_S, took
        assert ABANDONED not in log and tracebacks(log) == 0, log

        # Every attempt that was in flight is recorded, with its SPEC section 4 outcome.
        recorded = {
            (d, a): (kind, outcome, error)
            for d, a, kind, outcome, error in await rows(
                database_url,
                "SELECT delivery_id::text, attempt, payload->>'kind', outcome, error"
                " FROM webhook_outbox WHERE processed",
            )
        }
        assert len(first_hits) >= in_flight
        for hit in first_hits:
            assert hit.kind is not None
            kind, outcome, error = recorded[(hit.delivery_id, hit.attempt)]
            # A first attempt as its kind says; a retry made before the signal is answered 200.
            wanted = FIRST[kind][1:] if hit.attempt == 1 else ("delivered", None)
            assert (outcome, error) == wanted, (kind, hit.attempt, outcome, error)
        assert len(recorded) == len(first_hits)  # nothing completed unsent, nothing twice
        # Nothing else was claimed: the rest is pending (plus the retries just scheduled).
        retries = sum(1 for v in recorded.values() if v[1] == "retry")
        assert await pending(database_url) == len(kinds) - len(first_hits) + retries

        # A second dispatcher takes over and settles everything.
        second = await start_dispatcher(env, tmp_path / "second.log")
        procs.append(second)
        await wait_until(lambda: _drained(database_url), timeout=60, what="all settled")
        assert await stop_processes([second], TIMEOUT_S + DRAIN_GRACE_S + 10) == [0]
    finally:
        await stop_processes(procs)  # after a failure: none left behind
        await consumer.stop()
    print(
        f"\nSIGTERM with {in_flight} requests in flight: exited 0 after {took:.1f}s,"
        f" {len(first_hits)} attempts recorded"
    )
    accounting = await account(database_url, consumer)
    gone = kinds.count("gone")
    assert accounting.ok and accounting.lost == 0, accounting
    assert accounting.delivered == len(kinds) - gone, accounting
    assert accounting.dead_letters == gone, accounting
    assert accounting.duplicates == 0, accounting  # a clean stop sends nothing twice


async def _drained(database_url: str) -> bool:
    return await pending(database_url) == 0


async def test_a_stop_starts_no_request_left_waiting_for_a_slot(
    database_url: str, redis_url: str, redis_prefix: str, tmp_path: Path
) -> None:
    """Requests their batch left waiting for a slot of their endpoint are not sent once the
    process stops: each request ahead of them may take its whole timeout, so one started
    then could outlive the drain and be recorded by nobody (the consumer would have it, the
    outbox would send it again). Their rows are due again at once, for the next dispatcher,
    not held for their lease."""
    consumer = ChaosConsumer(lambda hit: Behaviour.SILENT if hit.attempt == 1 else Behaviour.OK)
    await consumer.start()
    env = dispatcher_env(
        database_url, redis_url, consumer.url, redis_prefix,
        WEBHOOK_TIMEOUT_MS="2000", WEBHOOK_BATCH_SIZE="4", WEBHOOK_CLAIM_LOOPS="1",
        WEBHOOK_ENDPOINT_CONCURRENCY="1", WEBHOOK_RETRY_SCHEDULE="1h",
    )  # fmt: skip
    procs: list[DispatcherProcess] = []
    try:
        proc = await start_dispatcher(env, tmp_path / "first.log")
        procs.append(proc)
        await enqueue_events(database_url, ["silent"] * 4)
        await consumer.wait_for(1)  # the first holds the one slot; three wait for it
        await wait_until(lambda: _leased(database_url), timeout=10, what="leases")
        assert await stop_processes([proc], 20) == [0], proc.log()
        log = proc.log()
        assert len(consumer.hits) == 1, [h.delivery_id for h in consumer.hits]
        assert "not recorded within" not in log and tracebacks(log) == 0, log
        [(outcome, error)] = await rows(
            database_url, "SELECT outcome, error FROM webhook_outbox WHERE processed"
        )
        assert (outcome, error) == ("retry", "timeout")
        # The three never sent are due now and free; the first's retry waits its hour.
        assert await _count(database_url, "created_at <= now() AND lease IS NULL") == 3

        second = await start_dispatcher(env, tmp_path / "second.log")
        procs.append(second)
        await wait_until(lambda: _sent_at_least(consumer, 4), timeout=30, what="the three sent")
    finally:
        await stop_processes(procs)
        await consumer.stop()


async def _count(database_url: str, where: str) -> int:
    return int(
        await scalar(
            database_url, f"SELECT count(*) FROM webhook_outbox WHERE NOT processed AND {where}"
        )
    )


async def _leased(database_url: str) -> bool:
    """The batch has left its requests (each under a lease)."""
    return await _count(database_url, "lease IS NOT NULL") > 0


async def _sent_at_least(consumer: ChaosConsumer, n: int) -> bool:
    return len(consumer.hits) >= n


async def test_a_request_left_waiting_by_a_batch_that_rolled_back_is_not_sent(
    database_url: str, redis_url: str, redis_prefix: str, tmp_path: Path
) -> None:
    """A batch whose commit fails after it left requests waiting for a slot of their
    endpoint: its leases were never written, so its rows are claimed and sent again at
    once. The waiting requests must then not be sent as well when the slot frees (the
    consumer would get those deliveries twice). The batch is made to fail by its own
    session ending as it writes the leases (once, by a trigger)."""
    first = True

    def choose(hit: Hit) -> Behaviour:
        nonlocal first
        silent, first = first, False
        return Behaviour.SILENT if silent else Behaviour.OK  # the first holds the slot 2 s

    consumer = ChaosConsumer(choose)
    await consumer.start()
    env = dispatcher_env(
        database_url, redis_url, consumer.url, redis_prefix,
        WEBHOOK_TIMEOUT_MS="2000", WEBHOOK_BATCH_SIZE="4", WEBHOOK_CLAIM_LOOPS="1",
        WEBHOOK_ENDPOINT_CONCURRENCY="1", WEBHOOK_RETRY_SCHEDULE="1h",
    )  # fmt: skip
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "CREATE SEQUENCE test_lease_fault;"
            " CREATE FUNCTION test_lease_fault() RETURNS trigger LANGUAGE plpgsql AS $$"
            " BEGIN"
            "   IF NEW.lease IS NOT NULL AND OLD.lease IS NULL"
            "      AND nextval('test_lease_fault') = 1 THEN"  # not rolled back: once
            "     PERFORM pg_terminate_backend(pg_backend_pid());"
            "   END IF;"
            "   RETURN NEW;"
            " END $$;"
            " CREATE TRIGGER test_lease_fault BEFORE UPDATE ON webhook_outbox"
            " FOR EACH ROW EXECUTE FUNCTION test_lease_fault()"
        )
    proc = await start_dispatcher(env, tmp_path / "dispatcher.log")
    try:
        await enqueue_events(database_url, ["ok"] * 4)
        await wait_until(lambda: _drained(database_url), timeout=30, what="all four delivered")
        await asyncio.sleep(1)  # a request sent late would arrive now
        faults = await scalar(database_url, "SELECT last_value FROM test_lease_fault")
        assert faults >= 1, proc.log()  # the batch did fail as it wrote its leases
        sent: dict[str, int] = {}
        for hit in consumer.hits:
            sent[hit.delivery_id] = sent.get(hit.delivery_id, 0) + 1
        # The first was sent by the failed batch (never answered, never recorded) and
        # again; each of the three that waited behind it is sent once, by the claim after.
        assert sorted(sent.values()) == [1, 1, 1, 2], (sent, proc.log())
    finally:
        await stop_processes([proc])
        await consumer.stop()
