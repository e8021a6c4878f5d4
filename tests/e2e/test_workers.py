"""``WEBHOOK_WORKERS`` (SPEC section 16): one ``run`` supervises several dispatcher
processes, replaces one that dies, serves one ``/metrics`` for all of them, and drains them
all on SIGTERM; it refuses to start when their connections would not fit."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
from pathlib import Path

import psutil
import psycopg
import pytest
from aiohttp import web

from tests.support.chaos import stop_processes, tracebacks
from tests.support.dispatch import delivered, enqueue_many, pending, wait_until
from tests.support.procs import (
    DispatcherProcess,
    dispatcher_env,
    free_port,
    run_command,
    start_dispatcher,
)
from tests.support.receiver import Received, Receiver
from tests.support.scrape import get_json, is_ready, scrape, total

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _workers(supervisor: DispatcherProcess) -> set[int]:
    """The pids of the supervisor's live worker processes."""
    live = set()
    for child in psutil.Process(supervisor.pid).children():
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                live.add(child.pid)
        except psutil.NoSuchProcess:
            pass  # reaped between the listing and the look at it
    return live


async def _said(log: str, words: str, times: int) -> bool:
    return log.count(words) >= times


def _sent_to(pid: int, receiver: Receiver) -> bool:
    """Whether the process holds a (keep-alive) connection to the consumer: it sent to it."""
    return any(
        c.raddr and c.raddr.port == receiver.port
        for c in psutil.Process(pid).net_connections(kind="tcp")
    )


async def _session_names(database_url: str) -> set[str]:
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        cur = await conn.execute(
            "SELECT application_name FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            " AND backend_type = 'client backend'"  # not an autovacuum worker
        )
        return {str(name) for (name,) in await cur.fetchall()}


async def test_two_workers_one_replaced_one_metrics_and_a_drain_that_loses_nothing(
    database_url: str, redis_url: str, redis_prefix: str, receiver: Receiver, tmp_path: Path
) -> None:
    delay: dict[str, float | None] = {"s": 0.02}
    # Set once both workers said they stop: the requests in flight are answered only then
    # (bounded below the request timeout), so none ends before the signal reached its
    # worker however loaded the machine is.
    release = asyncio.Event()

    async def respond(r: Received) -> web.Response:
        if delay["s"] is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(release.wait(), 4.0)
        else:
            await asyncio.sleep(delay["s"])
        return web.Response(status=200)

    receiver.respond = respond
    port = free_port()
    env = dispatcher_env(
        database_url, redis_url, receiver.url, redis_prefix,
        WEBHOOK_WORKERS="2", WEBHOOK_METRICS_PORT=str(port), WEBHOOK_BATCH_SIZE="5",
        WEBHOOK_CLAIM_LOOPS="2", WEBHOOK_POLL_INTERVAL_MS="200", WEBHOOK_TIMEOUT_MS="5000",
    )  # fmt: skip
    supervisor = await start_dispatcher(env, tmp_path / "supervisor.log")
    try:
        await wait_until(lambda: is_ready(port), timeout=30, what="both workers dispatching")
        first = _workers(supervisor)
        assert len(first) == 2, supervisor.log()

        # Both workers deliver; one /metrics sums them.
        await enqueue_many(database_url, 200)
        await wait_until(lambda: _delivered_is(database_url, 200), timeout=30, what="200")
        assert all(_sent_to(pid, receiver) for pid in first), "a worker sent nothing"
        samples = await scrape(port)
        assert total(samples, "fluxora_webhook_deliveries_total", outcome="delivered") == 200
        assert total(samples, "fluxora_webhook_workers", state="dispatching") == 2
        # Every session of the run is named as the docs say (pg_stat_activity): the
        # supervisor's and the workers' own (backlog gauges, readiness) were unnamed.
        names = await _session_names(database_url)
        assert names == {"fluxora-webhooks dispatcher"}, names

        # One worker killed (idle, so nothing of it is in flight): another takes its place.
        victim = min(first)
        os.kill(victim, signal.SIGKILL)

        async def unready() -> bool:  # while it is replaced: 503, with the workers' counts
            return await get_json(port, "/readyz") == (
                503,
                {
                    "status": "not ready",
                    "reason": "1 of 2 workers dispatching",
                    "workers": {"wanted": 2, "dispatching": 1},
                },
            )

        await wait_until(unready, timeout=10, what="not ready while a worker is replaced")

        async def replaced() -> bool:
            now = _workers(supervisor)
            return len(now) == 2 and victim not in now and await is_ready(port)

        await wait_until(replaced, timeout=30, what="a replacement worker")
        second = _workers(supervisor)
        assert second & first == first - {victim}
        assert f"(pid {victim}) was killed by SIGKILL" in supervisor.log()
        await enqueue_many(database_url, 100)
        await wait_until(lambda: _delivered_is(database_url, 300), timeout=30, what="300")
        samples = await scrape(port)
        # The dead worker's counts are kept: the sum is still every delivery.
        assert total(samples, "fluxora_webhook_deliveries_total", outcome="delivered") == 300
        assert total(samples, "fluxora_webhook_worker_restarts_total", cause="signal") == 1
        assert total(samples, "fluxora_webhook_worker_restarts_total") == 1
        assert not [name for name, _ in samples if name.endswith("_created")]
        assert total(samples, "fluxora_webhook_in_flight_requests") == 0
        # One worker reads the backlog for all: the gauge is that reading, not a sum.
        assert total(samples, "fluxora_webhook_outbox_pending") == 0

        # SIGTERM while both workers have batches in flight: both drain, exit 0.
        delay["s"] = None
        before = len(receiver.received)
        await enqueue_many(database_url, 40)
        in_flight = 2 * 2 * 5  # workers x claim loops x batch
        await receiver.wait_for(before + in_flight, timeout=10)
        assert await delivered(database_url) == 300, "the batches were not all in flight"
        supervisor.terminate()
        await wait_until(
            lambda: _said(supervisor.log(), "stopping on SIGTERM: finishing the in-flight", 2),
            timeout=10,
            what="both workers stopping",
        )
        release.set()
        code = await supervisor.wait(5 + 5 + 10)
    finally:
        await stop_processes([supervisor])
    log = supervisor.log()
    assert code == 0, log
    assert tracebacks(log) == 0, log
    assert not any(psutil.pid_exists(pid) for pid in second), "a worker outlived the supervisor"
    # Every request the consumer got is recorded; the rest waits; nothing was sent after.
    assert await delivered(database_url) == 300 + in_flight
    assert await pending(database_url) == 40 - in_flight
    assert len(receiver.received) == before + in_flight
    assert len({r.delivery_id for r in receiver.received}) == 300 + in_flight


async def test_workers_drain_by_themselves_when_the_supervisor_is_killed(
    database_url: str, redis_url: str, redis_prefix: str, receiver: Receiver, tmp_path: Path
) -> None:
    env = dispatcher_env(database_url, redis_url, receiver.url, redis_prefix, WEBHOOK_WORKERS="2")
    supervisor = await start_dispatcher(env, tmp_path / "supervisor.log")
    try:
        await wait_until(
            lambda: _logged(supervisor, "dispatching (", 2), timeout=30, what="two workers"
        )
        workers = _workers(supervisor)
        supervisor.kill()
        await supervisor.wait(10)

        async def gone() -> bool:
            return not any(psutil.pid_exists(p) for p in workers)

        await wait_until(gone, timeout=15, what="the workers to exit")
    finally:
        for pid in _orphans(supervisor):
            os.kill(pid, signal.SIGKILL)
    assert supervisor.log().count("stopped") == 2, supervisor.log()
    # Each says why it stops (no signal named it).
    said = f"the supervisor (pid {supervisor.pid}) is gone: this worker stops too"
    assert supervisor.log().count(said) == 2, supervisor.log()


async def test_workers_that_would_not_fit_in_max_connections_are_refused(
    database_url: str,
) -> None:
    env = dispatcher_env(
        database_url, "redis://127.0.0.1:1/0", "http://127.0.0.1:9/x", "p:",
        WEBHOOK_WORKERS="64", WEBHOOK_CLAIM_LOOPS="64",
    )  # fmt: skip
    code, out = await run_command("run", env=env, timeout=30)
    assert code == 2, out
    assert "configuration error: WEBHOOK_WORKERS: 64 workers x (64 claim loops + 2)" in out
    assert "max_connections" in out and "WEBHOOK_CLAIM_LOOPS" in out
    assert "Traceback" not in out


async def _delivered_is(database_url: str, n: int) -> bool:
    return await delivered(database_url) == n


async def _logged(proc: DispatcherProcess, text: str, times: int) -> bool:
    return proc.log().count(text) >= times


def _orphans(supervisor: DispatcherProcess) -> list[int]:
    """Workers of ``supervisor`` still alive after it died (none, when the test passes)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "fluxora_webhooks.worker" in cmdline and str(supervisor.pid) in cmdline:
            found.append(proc.pid)
    return found


async def test_the_supervisor_refuses_an_unmigrated_database_before_starting_workers(
    empty_database_url: str,
) -> None:
    env = dispatcher_env(
        empty_database_url, "redis://127.0.0.1:1/0", "http://127.0.0.1:9/x", "p:",
        WEBHOOK_WORKERS="2",
    )  # fmt: skip
    code, out = await run_command("run", env=env, timeout=30)
    assert code == 3, out
    assert "run `fluxora-webhooks migrate`" in out
    assert "worker 0 started" not in out and "Traceback" not in out


def _port_in_range() -> int:
    """A free port of the range these tests may use (47400-47499)."""
    for port in range(47400, 47500):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port in 47400-47499")


def _index_of(supervisor: DispatcherProcess, pid: int) -> int:
    found = re.search(rf"worker (\d+) started \(pid {pid}\)", supervisor.log())
    assert found, supervisor.log()
    return int(found.group(1))


RESTART_CAUSES = ("exit", "signal", "unresponsive")


async def test_a_stopped_worker_is_not_counted_then_killed_and_replaced(
    database_url: str, redis_url: str, redis_prefix: str, receiver: Receiver, tmp_path: Path
) -> None:
    """A worker that stops answering (SIGSTOP: alive, wedged, writing nothing) is not
    counted as dispatching once the supervisor has not heard it for the silent bound
    (/readyz 503 naming it), counted again when it answers (SIGCONT), and killed and
    replaced once silent past the unresponsive bound (counted as cause="unresponsive").
    The bounds are shortened by their test-only variables. The environment holds a
    PROMETHEUS_MULTIPROC_DIR of its own, as where gunicorn apps run: the supervisor's
    series are still all there from the first scrape, and nothing is written to it."""
    port = _port_in_range()
    inherited = tmp_path / "inherited-multiproc"
    inherited.mkdir()
    env = dispatcher_env(
        database_url, redis_url, receiver.url, redis_prefix,
        WEBHOOK_WORKERS="2", WEBHOOK_METRICS_PORT=str(port),
        FLUXORA_WORKER_SILENT_S="2", FLUXORA_WORKER_UNRESPONSIVE_S="8",
        PROMETHEUS_MULTIPROC_DIR=str(inherited),
    )  # fmt: skip
    supervisor = await start_dispatcher(env, tmp_path / "supervisor.log")
    victim = 0
    try:
        await wait_until(lambda: is_ready(port), timeout=30, what="both workers dispatching")
        samples = await scrape(port)
        for cause in RESTART_CAUSES:
            key = ("fluxora_webhook_worker_restarts_total", frozenset({("cause", cause)}))
            assert samples.get(key) == 0, (cause, sorted(k for k in samples if "restart" in k[0]))
        assert total(samples, "fluxora_webhook_workers", state="dispatching") == 2
        # Every session of the run is named as the docs say (pg_stat_activity): the
        # supervisor's and the workers' own (backlog gauges, readiness) were unnamed.
        names = await _session_names(database_url)
        assert names == {"fluxora-webhooks dispatcher"}, names
        first = _workers(supervisor)
        victim = max(first)
        index = _index_of(supervisor, victim)

        os.kill(victim, signal.SIGSTOP)

        async def named() -> bool:
            status, body = await get_json(port, "/readyz")
            return (
                status == 503
                and body["reason"].startswith(f"worker {index} has not answered for ")
                and body["workers"] == {"wanted": 2, "dispatching": 1}
            )

        await wait_until(named, timeout=2 + 5, what="/readyz naming the silent worker")
        samples = await scrape(port)
        assert total(samples, "fluxora_webhook_workers", state="dispatching") == 1
        assert f"worker {index} (pid {victim}) has not answered for" in supervisor.log()

        # It answers again: counted again, and said.
        os.kill(victim, signal.SIGCONT)
        await wait_until(lambda: is_ready(port), timeout=10, what="ready once it answers")
        assert f"worker {index} (pid {victim}) answers again" in supervisor.log()
        assert _workers(supervisor) == first

        # Silent past the unresponsive bound: killed and replaced.
        os.kill(victim, signal.SIGSTOP)

        async def replaced() -> bool:
            now = _workers(supervisor)
            return len(now) == 2 and victim not in now and await is_ready(port)

        await wait_until(replaced, timeout=8 + 2 + 30, what="the silent worker replaced")
        log = supervisor.log()
        assert f"(pid {victim}) was killed by SIGKILL (it had not answered)" in log, log
        samples = await scrape(port)
        assert total(samples, "fluxora_webhook_worker_restarts_total", cause="unresponsive") == 1
        assert total(samples, "fluxora_webhook_worker_restarts_total") == 1
        assert total(samples, "fluxora_webhook_workers", state="dispatching") == 2
        # Every session of the run is named as the docs say (pg_stat_activity): the
        # supervisor's and the workers' own (backlog gauges, readiness) were unnamed.
        names = await _session_names(database_url)
        assert names == {"fluxora-webhooks dispatcher"}, names
        supervisor.terminate()
        code = await supervisor.wait(5 + 5 + 10)
    finally:
        if victim and psutil.pid_exists(victim):
            os.kill(victim, signal.SIGKILL)
        await stop_processes([supervisor])
    log = supervisor.log()
    assert code == 0, log
    assert tracebacks(log) == 0, log
    assert list(inherited.iterdir()) == []


async def test_one_process_with_an_inherited_multiprocess_folder_shows_every_series(
    database_url: str, redis_url: str, redis_prefix: str, receiver: Receiver, tmp_path: Path
) -> None:
    """PROMETHEUS_MULTIPROC_DIR set where `run` starts (gunicorn apps' environments) is no
    sign of a supervisor's worker: a single process still shows the supervisor's series
    (1 and 1 workers, restarts at 0) and the per-endpoint ones, and writes nothing there."""
    port = _port_in_range()
    inherited = tmp_path / "inherited-multiproc"
    inherited.mkdir()
    env = dispatcher_env(
        database_url, redis_url, receiver.url, redis_prefix,
        WEBHOOK_METRICS_PORT=str(port), PROMETHEUS_MULTIPROC_DIR=str(inherited),
    )  # fmt: skip
    service = await start_dispatcher(env, tmp_path / "run.log")
    try:
        await wait_until(lambda: is_ready(port), timeout=30, what="dispatching")
        await enqueue_many(database_url, 3)
        await wait_until(lambda: _delivered_is(database_url, 3), timeout=30, what="3 delivered")

        async def endpoints_read() -> bool:
            samples = await scrape(port)
            return total(samples, "fluxora_webhook_endpoints", state="enabled") >= 1

        await wait_until(endpoints_read, timeout=20, what="the endpoints' series")
        samples = await scrape(port)
        assert total(samples, "fluxora_webhook_workers", state="wanted") == 1
        assert total(samples, "fluxora_webhook_workers", state="dispatching") == 1
        for cause in RESTART_CAUSES:
            key = ("fluxora_webhook_worker_restarts_total", frozenset({("cause", cause)}))
            assert samples.get(key) == 0, cause
        assert (
            "fluxora_webhook_endpoint_pending",
            frozenset({("endpoint", "_other"), ("tenant", "")}),
        ) in samples
        assert total(samples, "fluxora_webhook_deliveries_total", outcome="delivered") == 3
    finally:
        codes = await stop_processes([service])
    assert codes == [0], service.log()
    assert list(inherited.iterdir()) == []
