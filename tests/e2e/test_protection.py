"""Three dispatcher processes protect one failing consumer as one (SPEC sections 5 and 6),
and a Redis outage never stops deliveries."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from redis.asyncio import Redis

from fluxora_webhooks.redis_gate import OPEN, rate_limit_key, read_breaker_state
from tests.support.dispatch import enqueue_many, pending, scalar, wait_until
from tests.support.procs import dispatcher_env, dispatchers, free_port
from tests.support.receiver import Received, Receiver
from tests.support.redis_server import RedisServer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# Latency between the gate's admission (Redis clock) and the consumer's receipt (same host).
SKEW_S = 0.05


async def _dead_letters(database_url: str) -> int:
    return int(await scalar(database_url, "SELECT count(*) FROM webhook_dead_letter"))


async def test_retries_across_three_dispatchers_respect_the_shared_rate(
    database_url: str, redis_url: str, redis_prefix: str, receiver: Receiver, tmp_path: Path
) -> None:
    rps, events = 5, 12

    def respond(r: Received) -> web.Response:
        # Every event fails its first two attempts: 24 retries must queue behind the limit.
        return web.Response(status=503 if r.attempt <= 2 else 200)

    receiver.respond = respond
    await enqueue_many(database_url, events)
    env = dispatcher_env(
        database_url, redis_url, receiver.url, redis_prefix,
        WEBHOOK_RETRY_RPS=str(rps), WEBHOOK_RETRY_SCHEDULE="50ms", WEBHOOK_MAX_ATTEMPTS="3",
        WEBHOOK_BATCH_SIZE="5", WEBHOOK_CLAIM_LOOPS="2", WEBHOOK_POLL_INTERVAL_MS="100",
    )  # fmt: skip
    async with dispatchers(3, env, tmp_path):
        await wait_until(lambda: _drained(database_url), timeout=90, what="all delivered")

    retries = sorted(r.at for r in receiver.received if r.attempt > 1)
    assert len(retries) == 2 * events
    # Any rps + 1 consecutive retries span at least a second (less the admission-to-receipt
    # latency): never more than WEBHOOK_RETRY_RPS retries in a one-second window.
    for i in range(len(retries) - rps):
        assert retries[i + rps] - retries[i] >= 1 - SKEW_S, retries[i : i + rps + 1]
    # Deferrals consumed no attempt: with only 3 attempts allowed, nothing was dead-lettered.
    assert await _dead_letters(database_url) == 0
    counts = Counter(r.delivery_id for r in receiver.received if r.attempt == 3)
    assert len(counts) == events
    deferrals = await scalar(database_url, "SELECT sum(deferrals) FROM webhook_outbox")
    assert deferrals > 0  # the limiter really deferred retries


async def test_breaker_blocks_while_open_probes_once_per_period_and_recovers(
    database_url: str,
    redis_url: str,
    redis_prefix: str,
    redis_client: Redis,
    receiver: Receiver,
    tmp_path: Path,
) -> None:
    reset_ms, failing_for_s, events = 700, 3.0, 40
    failing_until: float | None = None

    def respond(r: Received) -> web.Response:
        nonlocal failing_until
        if failing_until is None:
            failing_until = r.at + failing_for_s
        return web.Response(status=503 if r.at < failing_until else 200)

    receiver.respond = respond
    await enqueue_many(database_url, events)
    env = dispatcher_env(
        database_url, redis_url, receiver.url, redis_prefix,
        WEBHOOK_CIRCUIT_BREAKER_THRESHOLD="3", WEBHOOK_CIRCUIT_BREAKER_RESET_MS=str(reset_ms),
        WEBHOOK_RETRY_RPS="1000", WEBHOOK_RETRY_SCHEDULE="50ms", WEBHOOK_MAX_ATTEMPTS="20",
        WEBHOOK_BATCH_SIZE="5", WEBHOOK_CLAIM_LOOPS="2", WEBHOOK_POLL_INTERVAL_MS="100",
    )  # fmt: skip
    open_periods: set[int] = set()  # reset_at (ms) of every open period seen

    async def watch() -> None:
        while True:
            state = await read_breaker_state(redis_client, receiver.url, redis_prefix)
            if state.state == OPEN:
                open_periods.add(state.reset_at_ms)
            await asyncio.sleep(0.01)

    watcher = asyncio.create_task(watch())
    try:
        async with dispatchers(3, env, tmp_path):
            await wait_until(lambda: _drained(database_url), timeout=90, what="all delivered")
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher

    assert failing_until is not None
    assert len(open_periods) >= 2, "the circuit never re-opened after a failed probe"
    times = sorted(r.at for r in receiver.received)
    for reset_at in open_periods:
        opened, closes = reset_at / 1000 - reset_ms / 1000, reset_at / 1000
        inside = [t for t in times if opened + SKEW_S < t < closes - SKEW_S]
        assert inside == [], f"{len(inside)} requests reached the consumer while open"
        # Exactly one probe between this period's end and the next period's start.
        later = [p / 1000 - reset_ms / 1000 for p in open_periods if p > reset_at]
        if later and min(later) < failing_until:
            probes = [t for t in times if closes - SKEW_S <= t <= min(later) + SKEW_S]
            assert len(probes) == 1, f"{len(probes)} probes in one half-open period"
    # It healed: everything delivered, nothing dead-lettered because of deferrals.
    assert await _dead_letters(database_url) == 0
    assert (
        await scalar(
            database_url, "SELECT count(*) FROM webhook_outbox WHERE outcome = 'delivered'"
        )
        == events
    )
    assert (await read_breaker_state(redis_client, receiver.url, redis_prefix)).state != OPEN


@contextlib.asynccontextmanager
async def _own_redis(tmp_path: Path) -> AsyncIterator[RedisServer]:
    server = RedisServer(free_port(), tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def test_redis_outage_does_not_stop_deliveries_and_protection_resumes(
    database_url: str, redis_prefix: str, receiver: Receiver, tmp_path: Path
) -> None:
    # Bounded inside the test's own loop: a failure is reported, never a hung teardown.
    async with asyncio.timeout(150), _own_redis(tmp_path) as server:
        url = f"redis://127.0.0.1:{server.port}/0"
        env = dispatcher_env(
            database_url, url, receiver.url, redis_prefix,
            WEBHOOK_BATCH_SIZE="5", WEBHOOK_CLAIM_LOOPS="2", WEBHOOK_POLL_INTERVAL_MS="100",
        )  # fmt: skip
        key = rate_limit_key(receiver.url, redis_prefix)
        client = Redis.from_url(url)
        try:
            async with dispatchers(2, env, tmp_path):
                await enqueue_many(database_url, 20)
                await receiver.wait_for(20, timeout=60)  # six processes starting
                assert await client.exists(key)  # the gate records attempts

                await asyncio.to_thread(server.stop)  # the receiver's loop keeps answering
                await enqueue_many(database_url, 50)
                await receiver.wait_for(70, timeout=30)  # delivered with Redis down
                await wait_until(lambda: _drained(database_url), what="drained during outage")

                await asyncio.to_thread(server.start)
                await client.aclose()
                client = Redis.from_url(url)
                # Protection resumes: once the gate's back-off after the failure is over,
                # attempts are recorded in the restarted Redis again (a few waves at most:
                # the first calls may still meet the back-off or a stale connection).
                sent, recorded = 70, 0
                for _ in range(20):
                    await enqueue_many(database_url, 5)
                    sent += 5
                    for _ in range(100):
                        recorded = max(recorded, int(await client.zcard(key)))
                        if recorded:
                            break
                        await asyncio.sleep(0.01)
                    await receiver.wait_for(sent, timeout=30)
                    if recorded:
                        break
                    await asyncio.sleep(0.5)
                await wait_until(lambda: _drained(database_url), what="drained after restart")
                assert recorded > 0
        finally:
            await client.aclose()
    assert len({r.delivery_id for r in receiver.received}) == sent
    assert await _dead_letters(database_url) == 0


async def _drained(database_url: str) -> bool:
    return await pending(database_url) == 0
