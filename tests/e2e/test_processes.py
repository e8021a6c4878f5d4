"""Dispatcher processes side by side, killed, and drained: at-least-once, no double claim."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import psycopg
import pytest
from aiohttp import web

from tests.support.dispatch import delivered, enqueue_many, pending, rows, scalar, wait_until
from tests.support.procs import dispatcher_env, dispatchers, start_dispatcher
from tests.support.receiver import Received, Receiver

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


async def test_three_dispatchers_never_claim_the_same_row(
    database_url: str, redis_url: str, redis_prefix: str, receiver: Receiver, tmp_path: Path
) -> None:
    n = 3000
    await enqueue_many(database_url, n)
    env = dispatcher_env(
        database_url,
        redis_url,
        receiver.url,
        redis_prefix,
        WEBHOOK_BATCH_SIZE="25",
        WEBHOOK_CLAIM_LOOPS="3",
    )
    async with dispatchers(3, env, tmp_path) as procs:
        await wait_until(lambda: _drained(database_url), timeout=120, what="all delivered")
        logs = [p.log() for p in procs]
    counts = Counter(r.delivery_id for r in receiver.received)
    assert len(counts) == n
    assert max(counts.values()) == 1, "a row was delivered twice without any crash"
    assert await scalar(database_url, "SELECT count(*) FROM webhook_outbox") == n
    assert await rows(database_url, "SELECT DISTINCT outcome FROM webhook_outbox") == [
        ("delivered",)
    ]
    assert all("Traceback" not in log for log in logs), logs


async def test_sigkill_mid_batch_loses_nothing(
    database_url: str, redis_url: str, redis_prefix: str, receiver: Receiver, tmp_path: Path
) -> None:
    async def slow(r: Received) -> web.Response:
        await asyncio.sleep(0.3)
        return web.Response(status=200)

    receiver.respond = slow
    n = 300
    await enqueue_many(database_url, n)
    env = dispatcher_env(
        database_url,
        redis_url,
        receiver.url,
        redis_prefix,
        WEBHOOK_BATCH_SIZE="10",
        WEBHOOK_CLAIM_LOOPS="2",
    )
    victim = await start_dispatcher(env, tmp_path / "victim.log")
    # Kill it while a batch is in flight: requests received, their rows not yet committed.
    await receiver.wait_for(15, timeout=30)
    victim.kill()
    assert await victim.wait(10) == -9
    # Requests the consumer got whose rows the victim never committed: really mid-batch.
    committed = await delivered(database_url)
    in_flight_at_kill = len(receiver.received) - committed
    async with dispatchers(2, env, tmp_path):
        await wait_until(lambda: _drained(database_url), timeout=120, what="all delivered")
    counts = Counter(r.delivery_id for r in receiver.received)
    assert len(counts) == n, "an event was lost"
    duplicates = sum(c - 1 for c in counts.values())
    # Only what the killed process had in flight (2 loops x 10 rows) can be sent twice.
    assert 0 < duplicates <= 20, duplicates
    assert in_flight_at_kill > 0
    assert await delivered(database_url) == n


async def test_sigterm_drains_the_in_flight_batch_and_exits_zero(
    database_url: str, redis_url: str, redis_prefix: str, receiver: Receiver, tmp_path: Path
) -> None:
    async def slow(r: Received) -> web.Response:
        await asyncio.sleep(1.0)
        return web.Response(status=200)

    receiver.respond = slow
    await enqueue_many(database_url, 30)
    env = dispatcher_env(
        database_url,
        redis_url,
        receiver.url,
        redis_prefix,
        WEBHOOK_BATCH_SIZE="10",
        WEBHOOK_CLAIM_LOOPS="1",
        WEBHOOK_TIMEOUT_MS="5000",
    )
    proc = await start_dispatcher(env, tmp_path / "drain.log")
    await receiver.wait_for(10, timeout=30)  # the first batch is in flight
    started = time.monotonic()
    proc.terminate()
    code = await proc.wait(5 + 5 + 5)
    took = time.monotonic() - started
    log = proc.log()
    assert code == 0, log
    assert took < 10, took  # bounded by the request timeout plus grace
    assert "Traceback" not in log, log
    # The in-flight batch was completed and recorded; nothing else was claimed.
    assert await delivered(database_url) == len(receiver.received) == 10
    assert await pending(database_url) == 20
    await asyncio.sleep(0.5)
    assert len(receiver.received) == 10


async def _drained(database_url: str) -> bool:
    return await pending(database_url) == 0


async def test_sigterm_drain_is_bounded_when_the_database_hangs(
    database_url: str, redis_url: str, redis_prefix: str, receiver: Receiver, tmp_path: Path
) -> None:
    receiver.respond = lambda r: web.Response(status=410)  # each row needs a dead letter
    await enqueue_many(database_url, 5)
    env = dispatcher_env(
        database_url, redis_url, receiver.url, redis_prefix,
        WEBHOOK_BATCH_SIZE="10", WEBHOOK_CLAIM_LOOPS="1", WEBHOOK_TIMEOUT_MS="2000",
    )  # fmt: skip
    async with await psycopg.AsyncConnection.connect(database_url) as blocker:
        # An operator's long transaction: the batch cannot write its dead letters.
        await blocker.execute("LOCK TABLE webhook_dead_letter IN ACCESS EXCLUSIVE MODE")
        proc = await start_dispatcher(env, tmp_path / "hung.log")
        await receiver.wait_for(5, timeout=30)
        await asyncio.sleep(0.5)
        started = time.monotonic()
        proc.terminate()
        code = await proc.wait(30)
        took = time.monotonic() - started
        await blocker.rollback()
    assert code == 0, proc.log()
    assert took < 2 + 5 + 3, took  # the request timeout plus the grace period
    assert "abandoning the in-flight batch" in proc.log()
    # Nothing lost: the abandoned batch was rolled back and is delivered by the next run.
    assert await pending(database_url) == 5
    async with dispatchers(1, env, tmp_path):
        await wait_until(lambda: _drained(database_url), timeout=30, what="dead-lettered")
    assert await scalar(database_url, "SELECT count(*) FROM webhook_dead_letter") == 5


async def test_a_second_sigterm_stops_at_once(
    database_url: str, redis_url: str, redis_prefix: str, receiver: Receiver, tmp_path: Path
) -> None:
    async def never(r: Received) -> web.Response:
        await asyncio.sleep(60)
        return web.Response()

    receiver.respond = never
    await enqueue_many(database_url, 3)
    env = dispatcher_env(
        database_url, redis_url, receiver.url, redis_prefix, WEBHOOK_TIMEOUT_MS="30000"
    )
    proc = await start_dispatcher(env, tmp_path / "twice.log")
    await receiver.wait_for(3, timeout=30)
    started = time.monotonic()
    proc.terminate()
    await asyncio.sleep(0.5)
    proc.terminate()
    code = await proc.wait(20)
    assert code == 0, proc.log()
    assert time.monotonic() - started < 10  # not the 35 s drain bound
    assert "a second signal" in proc.log()
    assert await pending(database_url) == 3  # rolled back, to be delivered later
