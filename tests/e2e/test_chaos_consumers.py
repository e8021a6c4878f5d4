"""Hostile consumers (SPEC section 4): a real dispatcher process against a consumer that
answers too late or never, resets connections mid-response, streams endless bodies, sends
huge or unparseable headers, 2xx with garbage, and drops keep-alive connections at random.

For each: the attempt's recorded outcome is the one SPEC section 4 names, nothing is lost
(every event ends delivered or dead-lettered), and the dispatcher stays healthy and bounded
(alive, /healthz answers, no request left in flight, memory and descriptors bounded)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from tests.support.chaos import (
    Behaviour,
    ChaosConsumer,
    Hit,
    account,
    enqueue_events,
    http_get,
    metric,
    open_fds,
    rss_bytes,
    stop_processes,
    tracebacks,
)
from tests.support.dispatch import pending, rows, wait_until
from tests.support.procs import DispatcherProcess, dispatcher_env, free_port, start_dispatcher

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TIMEOUT_MS = 1000
MAX_BODY = 4096

# What SPEC section 4 says the first attempt's outcome is, when the consumer misbehaves so.
FIRST_ATTEMPT = {
    Behaviour.OK: "delivered",
    Behaviour.RETRY: "retry",  # 5xx
    Behaviour.GONE: "dead_letter",  # other 4xx: permanent
    Behaviour.SLOW: "retry",  # timeout
    Behaviour.SILENT: "retry",  # timeout
    Behaviour.RESET_HEAD: "retry",  # network error before a status
    Behaviour.RESET_BODY: "delivered",  # the 2xx status counts; the body is cut short
    Behaviour.ENDLESS: "delivered",  # read up to WEBHOOK_MAX_RESPONSE_BYTES, truncated
    Behaviour.TRICKLE: "delivered",  # the 2xx status counts; the body read times out
    Behaviour.HUGE_HEADERS: "delivered",
    Behaviour.OVERSIZED_HEADER: "retry",  # no parseable response: a network error
    Behaviour.GARBAGE_2XX: "delivered",  # any 2xx, whatever its content
}


@pytest_asyncio.fixture
async def consumer() -> AsyncIterator[ChaosConsumer]:
    c = ChaosConsumer(slow_s=TIMEOUT_MS / 1000 + 1.5)
    await c.start()
    try:
        yield c
    finally:
        await c.stop()


def _env(
    database_url: str, redis_url: str, prefix: str, consumer: ChaosConsumer, **extra: str
) -> dict[str, str]:
    settings = {
        "WEBHOOK_TIMEOUT_MS": str(TIMEOUT_MS), "WEBHOOK_RETRY_SCHEDULE": "100ms",
        "WEBHOOK_MAX_ATTEMPTS": "3", "WEBHOOK_BATCH_SIZE": "10", "WEBHOOK_CLAIM_LOOPS": "2",
        "WEBHOOK_POLL_INTERVAL_MS": "200", "WEBHOOK_RETRY_RPS": "1000",
        "WEBHOOK_METRICS_PORT": str(free_port()),
    }  # fmt: skip
    return dispatcher_env(database_url, redis_url, consumer.url, prefix, **(settings | extra))


async def _healthy(proc: DispatcherProcess, port: int) -> None:
    """Alive, /healthz answers, nothing left in flight, no traceback in its log."""
    assert proc.proc.returncode is None, proc.log()
    status, _ = await http_get(port, "/healthz")
    assert status == 200
    _, text = await http_get(port, "/metrics")
    assert metric(text, "fluxora_webhook_in_flight_requests") == 0
    assert tracebacks(proc.log()) == 0, proc.log()


async def _stop(proc: DispatcherProcess) -> None:
    assert await stop_processes([proc], TIMEOUT_MS / 1000 + 10) == [0], proc.log()


async def _wait_http(port: int) -> None:
    async def up() -> bool:
        try:
            return (await http_get(port, "/healthz"))[0] == 200
        except OSError:
            return False

    await wait_until(up, timeout=30, what="the service endpoint")


async def test_every_misbehaviour_gets_the_outcome_spec_section_4_names(
    database_url: str,
    redis_url: str,
    redis_prefix: str,
    consumer: ChaosConsumer,
    tmp_path: Path,
) -> None:
    per_kind = 12
    kinds = [b.value for b in FIRST_ATTEMPT for _ in range(per_kind)]

    def choose(hit: Hit) -> Behaviour:
        # The misbehaviour on the first attempt; later attempts are answered 200.
        return Behaviour(hit.kind or "ok") if hit.attempt == 1 else Behaviour.OK

    consumer.choose = choose
    env = _env(
        database_url, redis_url, redis_prefix, consumer, WEBHOOK_MAX_RESPONSE_BYTES=str(MAX_BODY)
    )
    port = int(env["WEBHOOK_METRICS_PORT"])
    proc = await start_dispatcher(env, tmp_path / "dispatcher.log")
    try:
        await _wait_http(port)
        await enqueue_events(database_url, kinds)
        await wait_until(lambda: _drained(database_url), timeout=90, what="all events settled")
        await _healthy(proc, port)
    finally:
        await _stop(proc)

    first = await rows(
        database_url,
        "SELECT payload->>'kind', outcome, status_code, error, length(response_body)"
        " FROM webhook_outbox WHERE attempt = 1 ORDER BY id",
    )
    assert len(first) == len(kinds)
    print("\n" + "\n".join(sorted({f"{r[0]:>16}: {r[1]} {r[2]} {r[3]}" for r in first})))
    wrong = [r for r in first if r[1] != FIRST_ATTEMPT[Behaviour(r[0])]]
    assert wrong == [], wrong
    for kind, _, status, error, body_len in first:
        b = Behaviour(kind)
        if b in (Behaviour.SLOW, Behaviour.SILENT):
            assert error == "timeout", (kind, error)
        if b in (Behaviour.RESET_HEAD, Behaviour.OVERSIZED_HEADER):
            assert status is None and error, (kind, status, error)
        if b in (Behaviour.RESET_BODY, Behaviour.TRICKLE):
            assert status == 200 and error.startswith("response body unreadable"), (kind, error)
        if b is Behaviour.ENDLESS:
            assert (status, error, body_len) == (200, None, MAX_BODY)  # truncated, not an error
        if b is Behaviour.GARBAGE_2XX:
            assert status == 299 and body_len > 0, (kind, status, body_len)
        if b is Behaviour.GONE:
            assert status == 410, (kind, status)
    # Retried ones were delivered on attempt 2; the 410s are dead letters; nothing lost.
    second = await rows(database_url, "SELECT outcome FROM webhook_outbox WHERE attempt = 2")
    retried = per_kind * list(FIRST_ATTEMPT.values()).count("retry")
    assert second == [("delivered",)] * retried
    dead = await rows(database_url, "SELECT reason, last_status, attempts FROM webhook_dead_letter")
    assert dead == [("http_4xx", 410, 1)] * per_kind
    accounting = await account(database_url, consumer)
    assert accounting.ok and accounting.lost == 0, accounting
    assert accounting.written == len(kinds)
    assert accounting.delivered == len(kinds) - per_kind


async def test_a_consumer_that_accepts_connections_and_never_answers(
    database_url: str,
    redis_url: str,
    redis_prefix: str,
    consumer: ChaosConsumer,
    tmp_path: Path,
) -> None:
    consumer.blackhole_connections = 6
    env = _env(database_url, redis_url, redis_prefix, consumer)
    port = int(env["WEBHOOK_METRICS_PORT"])
    proc = await start_dispatcher(env, tmp_path / "dispatcher.log")
    try:
        await _wait_http(port)
        await enqueue_events(database_url, ["ok"] * 40)
        await wait_until(lambda: _drained(database_url), timeout=60, what="all events settled")
        await _healthy(proc, port)
    finally:
        await _stop(proc)
    assert consumer.blackholed == 6
    # Each black-holed connection carried one request, which timed out and was retried.
    timed_out = await rows(
        database_url,
        "SELECT attempt, outcome, error FROM webhook_outbox WHERE outcome <> 'delivered'",
    )
    assert timed_out == [(1, "retry", "timeout")] * 6
    accounting = await account(database_url, consumer)
    assert accounting.ok and accounting.delivered == 40, accounting


async def test_keep_alive_connections_closed_at_random(
    database_url: str,
    redis_url: str,
    redis_prefix: str,
    consumer: ChaosConsumer,
    tmp_path: Path,
) -> None:
    consumer.close_probability = 0.5
    events = 600
    env = _env(database_url, redis_url, redis_prefix, consumer, WEBHOOK_MAX_ATTEMPTS="8")
    port = int(env["WEBHOOK_METRICS_PORT"])
    proc = await start_dispatcher(env, tmp_path / "dispatcher.log")
    try:
        await _wait_http(port)
        for start in range(0, events, 50):  # in waves, so pooled connections are reused
            await enqueue_events(database_url, ["ok"] * 50, first_n=start + 1)
            await wait_until(lambda: _drained(database_url), timeout=60, what="a wave settled")
        await _healthy(proc, port)
        assert open_fds(proc.pid) < 200  # closed connections are not leaked
    finally:
        await _stop(proc)
    # A request sent on a connection the consumer had just closed fails as a network error
    # and is retried; nothing else goes wrong.
    failures = await rows(
        database_url,
        "SELECT outcome, status_code, error FROM webhook_outbox WHERE outcome <> 'delivered'",
    )
    print(f"\nkeep-alive closed at random: {len(failures)} attempt(s) hit a stale connection")
    assert all(o == "retry" and s is None and e for o, s, e in failures), failures
    accounting = await account(database_url, consumer)
    assert accounting.ok and accounting.delivered == events, accounting
    assert await rows(database_url, "SELECT count(*) FROM webhook_dead_letter") == [(0,)]


async def test_endless_bodies_are_read_up_to_the_cap_and_memory_stays_bounded(
    database_url: str,
    redis_url: str,
    redis_prefix: str,
    consumer: ChaosConsumer,
    tmp_path: Path,
) -> None:
    consumer.choose = lambda hit: Behaviour(hit.kind or "ok")
    env = _env(database_url, redis_url, redis_prefix, consumer, WEBHOOK_TIMEOUT_MS="3000")
    port = int(env["WEBHOOK_METRICS_PORT"])
    proc = await start_dispatcher(env, tmp_path / "dispatcher.log")
    try:
        await _wait_http(port)
        await enqueue_events(database_url, ["ok"] * 100)  # warm up: the baseline
        await wait_until(lambda: _drained(database_url), timeout=60, what="warm-up")
        baseline = rss_bytes(proc.pid)
        endless = 300
        await enqueue_events(database_url, ["endless"] * endless, first_n=101)
        peak = baseline
        while not await _drained(database_url):
            peak = max(peak, rss_bytes(proc.pid))
            assert proc.proc.returncode is None, proc.log()
        peak = max(peak, rss_bytes(proc.pid))
        await _healthy(proc, port)
        fds = open_fds(proc.pid)
    finally:
        await _stop(proc)
    kept = await rows(
        database_url,
        "SELECT outcome, status_code, length(response_body) FROM webhook_outbox"
        " WHERE payload->>'kind' = 'endless'",
    )
    # Every endless body was cut at WEBHOOK_MAX_RESPONSE_BYTES (65536) and counted delivered.
    assert kept == [("delivered", 200, 65536)] * endless
    # Each endless request pushed far more than it kept, yet the process did not grow:
    # 20 requests in flight x 64 KiB (plus aiohttp's bounded read buffer) is a few MB.
    print(
        f"\nendless bodies: consumer pushed {consumer.endless_bytes_sent / 2**20:.0f} MiB,"
        f" dispatcher RSS {baseline / 2**20:.0f} -> peak {peak / 2**20:.0f} MiB, {fds} fds"
    )
    assert consumer.endless_bytes_sent > endless * 65536
    assert peak - baseline < 64 * 2**20, (baseline, peak)
    assert fds < 200


async def _drained(database_url: str) -> bool:
    return await pending(database_url) == 0
