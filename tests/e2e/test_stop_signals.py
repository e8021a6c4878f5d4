"""SIGQUIT stops `run` as SIGTERM does (docs/operations.md, "Stopping"): sent while batches
are in flight, to one process or to a supervisor, it drains them and exits 0 (its log names
the signal); every request
the consumer got is recorded once, nothing is left claimed under a lease, and no worker
outlives the supervisor."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import psutil
import pytest
from aiohttp import web

from tests.support.chaos import stop_processes, tracebacks
from tests.support.dispatch import delivered, enqueue_many, pending, scalar, wait_until
from tests.support.procs import dispatcher_env, start_dispatcher
from tests.support.receiver import Received, Receiver

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TIMEOUT_S = 5
DRAIN_GRACE_S = 5
KILL_MARGIN_S = 5
BATCH, LOOPS = 5, 2
EVENTS = 60


@pytest.mark.parametrize("workers", [1, 2])
async def test_sigquit_drains_the_in_flight_batches_and_exits_0(
    workers: int,
    database_url: str,
    redis_url: str,
    redis_prefix: str,
    receiver: Receiver,
    tmp_path: Path,
) -> None:
    async def respond(r: Received) -> web.Response:
        await asyncio.sleep(1.0)  # slow enough that the signal finds every batch in flight
        return web.Response(status=200)

    receiver.respond = respond
    env = dispatcher_env(
        database_url, redis_url, receiver.url, redis_prefix,
        WEBHOOK_WORKERS=str(workers), WEBHOOK_BATCH_SIZE=str(BATCH),
        WEBHOOK_CLAIM_LOOPS=str(LOOPS), WEBHOOK_TIMEOUT_MS=str(TIMEOUT_S * 1000),
    )  # fmt: skip
    proc = await start_dispatcher(env, tmp_path / "run.log")
    try:
        await wait_until(
            lambda: _logged(proc.log(), "dispatching (", workers), timeout=30, what="dispatching"
        )
        children = {c.pid for c in psutil.Process(proc.pid).children()}
        assert len(children) == (workers if workers > 1 else 0), proc.log()
        await enqueue_many(database_url, EVENTS)
        in_flight = workers * LOOPS * BATCH
        await receiver.wait_for(in_flight, timeout=15)
        assert await delivered(database_url) == 0, "the batches were not all in flight"
        proc.proc.send_signal(signal.SIGQUIT)
        code = await proc.wait(TIMEOUT_S + DRAIN_GRACE_S + KILL_MARGIN_S + 10)
    finally:
        await stop_processes([proc])  # after a failure: none left behind
    log = proc.log()
    assert code == 0, log
    assert tracebacks(log) == 0 and "abandoning" not in log, log
    # Each process said it stopped: the one, or the supervisor and each worker.
    assert log.count(": stopped") == (workers + 1 if workers > 1 else 1), log
    # Who stopped it: the signal sent, and each worker's from its supervisor.
    if workers > 1:
        assert log.count("stopping on SIGQUIT: the workers finish") == 1, log
        assert log.count("stopping on SIGTERM: finishing the in-flight batch") == workers, log
    else:
        assert log.count("stopping on SIGQUIT: finishing the in-flight batch") == 1, log
    assert not any(psutil.pid_exists(pid) for pid in children), "a worker outlived run"
    # Every request the consumer got is recorded as delivered, once; the rest waits, due and
    # claimable at once (no lease left behind).
    got = len(receiver.received)
    assert in_flight <= got < EVENTS, got
    assert len({r.delivery_id for r in receiver.received}) == got
    assert await delivered(database_url) == got
    assert await pending(database_url) == EVENTS - got
    leased = "SELECT count(*) FROM webhook_outbox WHERE NOT processed AND lease IS NOT NULL"
    assert await scalar(database_url, leased) == 0


async def _logged(log: str, text: str, times: int) -> bool:
    return log.count(text) >= times


# `fluxora-webhooks <command>` as its console script runs it, with SIGTERM sent to itself
# while the command's modules load: before its event loop's handlers exist.
_EARLY_SIGTERM = """
import os, signal, sys
from fluxora_webhooks import cli
load = cli._modules
def loading():
    os.kill(os.getpid(), signal.SIGTERM)
    return load()
cli._modules = loading
sys.argv = ["fluxora-webhooks", sys.argv[1]]
sys.exit(cli.main())
"""


@pytest.mark.parametrize("command", ["run", "api"])
async def test_a_sigterm_during_start_up_stops_it_cleanly(
    command: str, database_url: str, redis_url: str, redis_prefix: str, tmp_path: Path
) -> None:
    """A SIGTERM in the first second (imports, configuration) ended the process with 143
    and no line; now it stops as soon as it can, says so, exit 0."""
    env = dispatcher_env(
        database_url, redis_url, "https://hooks.example.com/x", redis_prefix,
        WEBHOOK_API_PORT="0", WEBHOOK_RETENTON="7d",
    )  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _EARLY_SIGTERM, command, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    log = out.decode(errors="replace")
    assert proc.returncode == 0, log
    assert "stopping on SIGTERM" in log and tracebacks(log) == 0, log
    assert "serving on" not in log, log
    # A misspelt variable is warned about (its value never shown).
    assert "WEBHOOK_RETENTON is set but is no variable fluxora-webhooks reads (did you mean" in log


async def test_api_stops_on_a_signal_while_its_database_does_not_answer(
    database_url: str, redis_url: str, redis_prefix: str
) -> None:
    """`api` checks its database before it serves; one that accepts and never answers held
    it up to the connect timeout, the stop signal kept and never acted on (exit 1 after
    11 s). The signal ends the check: exit 0."""
    hung: list[asyncio.StreamWriter] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hung.append(writer)  # never answered

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    env = dispatcher_env(
        f"postgresql://u@127.0.0.1:{port}/db", redis_url, "https://hooks.example.com/x",
        redis_prefix, WEBHOOK_API_PORT="0",
    )  # fmt: skip
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fluxora_webhooks", "api", env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        await wait_until(lambda: _connected(hung), 30, "api connecting to the database")
        proc.send_signal(signal.SIGINT)
        out, _ = await asyncio.wait_for(proc.communicate(), 8)
    finally:
        server.close()
        for writer in hung:
            writer.close()
    log = out.decode(errors="replace")
    assert proc.returncode == 0, log
    assert "stopping on SIGINT" in log and tracebacks(log) == 0, log


async def _connected(hung: list[asyncio.StreamWriter]) -> bool:
    return bool(hung)
