"""`run` started before its database answers waits for it (WEBHOOK_STARTUP_WAIT_MS), each
attempt logged, and then dispatches; a refusal that waiting does not cure stops it at once;
a stop during the wait exits cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

from tests.support.chaos import stop_processes, tracebacks, wait_ready
from tests.support.dispatch import enqueue_many, wait_until
from tests.support.procs import DispatcherProcess, dispatcher_env, free_port, start_dispatcher
from tests.support.receiver import Receiver
from tests.support.scrape import get_json, is_ready

pytestmark = pytest.mark.e2e

WAITING = "database not reachable yet"


def _on_port(url: str, port: int) -> str:
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    user = f"{parts.username}@" if parts.username else ""
    return urlunsplit(parts._replace(netloc=f"{user}{host}:{port}"))


@contextlib.asynccontextmanager
async def _proxy(port: int, target: str) -> AsyncIterator[None]:
    """From now on, 127.0.0.1:``port`` forwards to the database ``target`` names."""
    parts = urlsplit(target)
    host, dest = parts.hostname or "127.0.0.1", parts.port or 5432

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(host, dest)
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    server = await asyncio.start_server(serve, "127.0.0.1", port)
    try:
        yield
    finally:
        server.close()


async def _log_says(proc: object, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in proc.log():  # type: ignore[attr-defined]
        if proc.proc.returncode is not None or time.monotonic() > deadline:  # type: ignore[attr-defined]
            raise AssertionError(f"{text!r} not in the log:\n{proc.log()}")  # type: ignore[attr-defined]
        await asyncio.sleep(0.05)


async def test_run_waits_for_a_database_that_comes_up_late_then_dispatches(
    database_url: str, redis_url: str, prefix: str, receiver: Receiver, tmp_path: Path
) -> None:
    port = free_port()  # nothing listens there yet: connection refused
    env = dispatcher_env(_on_port(database_url, port), redis_url, receiver.url, prefix)
    proc = await start_dispatcher(env, tmp_path / "dispatcher.log")
    try:
        await _log_says(proc, WAITING, timeout=30)
        await asyncio.sleep(1.0)  # a second attempt or more, still waiting, still running
        assert proc.proc.returncode is None, proc.log()
        async with _proxy(port, database_url):
            await _delivers_and_stops(proc, database_url, receiver)
    finally:
        await stop_processes([proc])
    assert len({r.delivery_id for r in receiver.received}) == 3


async def _delivers_and_stops(
    proc: DispatcherProcess, database_url: str, receiver: Receiver
) -> None:
    """Once what it waited for is there: it dispatches, delivers three new events and
    stops cleanly on SIGTERM, with no traceback."""
    await wait_ready(proc, timeout=30)
    await enqueue_many(database_url, 3)
    await receiver.wait_for(3, timeout=30)
    codes = await stop_processes([proc])
    assert codes == [0], proc.log()
    assert tracebacks(proc.log()) == 0, proc.log()


async def test_a_refusal_that_waiting_does_not_cure_stops_start_up_at_once(
    database_url: str, redis_url: str, prefix: str, receiver: Receiver, tmp_path: Path
) -> None:
    parts = urlsplit(database_url)
    missing = urlunsplit(parts._replace(path="/no_such_database_here"))
    env = dispatcher_env(
        missing, redis_url, receiver.url, prefix, WEBHOOK_STARTUP_WAIT_MS="600000"
    )  # ten minutes of waiting allowed: it must not use them
    proc = await start_dispatcher(env, tmp_path / "dispatcher.log")
    try:
        code = await proc.wait(60)
    finally:
        await stop_processes([proc])
    assert code == 1, proc.log()
    assert "cannot reach the database" in proc.log() and "does not exist" in proc.log()
    assert WAITING not in proc.log() and tracebacks(proc.log()) == 0


async def test_a_stop_during_the_wait_exits_cleanly(
    database_url: str, redis_url: str, prefix: str, receiver: Receiver, tmp_path: Path
) -> None:
    env = dispatcher_env(_on_port(database_url, free_port()), redis_url, receiver.url, prefix)
    proc = await start_dispatcher(env, tmp_path / "dispatcher.log")
    try:
        await _log_says(proc, WAITING, timeout=30)
        proc.terminate()
        code = await proc.wait(30)
    finally:
        await stop_processes([proc])
    assert code == 0, proc.log()
    assert tracebacks(proc.log()) == 0, proc.log()
    assert receiver.received == []


async def test_a_stop_during_a_connection_attempt_that_hangs_exits_cleanly(
    database_url: str, redis_url: str, prefix: str, receiver: Receiver, tmp_path: Path
) -> None:
    """A server that accepts and never answers: the attempt would last its 10 s
    connect_timeout; a SIGTERM during it is not held for that long."""
    reached = asyncio.Event()
    held: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        reached.set()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    env = dispatcher_env(_on_port(database_url, port), redis_url, receiver.url, prefix)
    proc = await start_dispatcher(env, tmp_path / "dispatcher.log")
    try:
        await asyncio.wait_for(reached.wait(), 30)  # `run` is in its connection attempt
        proc.terminate()
        code = await proc.wait(8)  # before that attempt would have timed out
    finally:
        await stop_processes([proc])
        for writer in held:
            writer.close()
        server.close()
    assert code == 0, proc.log()
    assert tracebacks(proc.log()) == 0, proc.log()


async def test_readyz_says_starting_until_the_dispatcher_dispatches(
    database_url: str, redis_url: str, prefix: str, receiver: Receiver, tmp_path: Path
) -> None:
    """/readyz is 200 only once `run` dispatches (its built-in endpoints recorded): while
    another transaction holds the endpoints table, it answers 503 "starting" (an
    orchestrator, or a test, that took 200 then would act on a dispatcher not yet running);
    once the table is free it is ready and delivers."""
    port = free_port()
    env = dispatcher_env(
        database_url, redis_url, receiver.url, prefix, WEBHOOK_METRICS_PORT=str(port)
    )
    async with await psycopg.AsyncConnection.connect(database_url) as holder:
        await holder.execute("LOCK TABLE webhook_endpoints IN SHARE ROW EXCLUSIVE MODE")
        proc = await start_dispatcher(env, tmp_path / "dispatcher.log")
        try:
            status, body = 0, None
            while status == 0:
                assert proc.proc.returncode is None, proc.log()
                status, body = await get_json(port, "/readyz")
                await asyncio.sleep(0.05)
            assert (status, body) == (503, {"status": "not ready", "reason": "starting"})
            assert "dispatching (" not in proc.log()
            await holder.rollback()
            await wait_ready(proc, timeout=30)
            await wait_until(lambda: is_ready(port), timeout=30, what="ready")
            await enqueue_many(database_url, 2)
            await receiver.wait_for(2, timeout=30)
            codes = await stop_processes([proc])
        finally:
            await stop_processes([proc])
    assert codes == [0], proc.log()
    assert tracebacks(proc.log()) == 0, proc.log()


async def _read_only(database_url: str, on: bool) -> None:
    """The database switched to read-only (as a standby is, or a managed server whose
    storage is full), its sessions ended so that the new ones are; or back, for new
    sessions only: the open ones stay read-only, and the dispatcher must not keep them."""
    name = urlsplit(database_url).path.lstrip("/")
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute("SET default_transaction_read_only = off")
        await conn.execute(
            f"ALTER DATABASE {name} SET default_transaction_read_only = {'on' if on else 'off'}"
        )
        if on:
            await conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )


READ_ONLY = "database is read-only (default_transaction_read_only is on)"


async def test_run_waits_for_a_read_only_database_to_accept_writes(
    database_url: str, redis_url: str, prefix: str, receiver: Receiver, tmp_path: Path
) -> None:
    """A standby (a failover not finished, a URL naming a replica) accepts the connection
    and refuses every claim: `run` waits for it like an absent server, saying why and what
    to do, and dispatches once it accepts writes; when the wait is over, it exits 1."""
    await _read_only(database_url, True)
    env = dispatcher_env(database_url, redis_url, receiver.url, prefix)
    proc = await start_dispatcher(env, tmp_path / "dispatcher.log")
    try:
        await _log_says(proc, READ_ONLY, timeout=30)
        assert "target_session_attrs=read-write" in proc.log()
        assert "dispatching (" not in proc.log()
        await _read_only(database_url, False)
        await _delivers_and_stops(proc, database_url, receiver)
    finally:
        await stop_processes([proc])

    await _read_only(database_url, True)
    env = dispatcher_env(
        database_url, redis_url, receiver.url, prefix, WEBHOOK_STARTUP_WAIT_MS="1000"
    )
    proc = await start_dispatcher(env, tmp_path / "dispatcher2.log")
    try:
        code = await proc.wait(60)
    finally:
        await stop_processes([proc])
    assert code == 1, proc.log()
    assert f"fluxora-webhooks: the {READ_ONLY}: DATABASE_URL must reach" in proc.log()
    assert tracebacks(proc.log()) == 0, proc.log()


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_database_that_turns_read_only_is_reported_not_ready_and_waited_out(
    workers: int,
    database_url: str,
    redis_url: str,
    prefix: str,
    receiver: Receiver,
    tmp_path: Path,
) -> None:
    """A running dispatcher whose database turns read-only (its pool reconnected to a
    standby after a failover): /readyz is 503 naming it, the log says it once (not a
    traceback per claim loop every few seconds), nothing is lost, and once the database
    accepts writes again the events written meanwhile elsewhere are delivered."""
    port = free_port()
    env = dispatcher_env(
        database_url,
        redis_url,
        receiver.url,
        prefix,
        WEBHOOK_METRICS_PORT=str(port),
        WEBHOOK_WORKERS=str(workers),
    )
    proc = await start_dispatcher(env, tmp_path / "dispatcher.log")
    try:
        await wait_ready(proc, timeout=30)
        await wait_until(lambda: is_ready(port), timeout=30, what="ready")
        await _read_only(database_url, True)

        async def not_ready() -> bool:
            status, body = await get_json(port, "/readyz")
            return status == 503 and "the database is read-only" in str(body)

        await wait_until(not_ready, timeout=30, what="/readyz 503 read-only")
        await _log_says(proc, "the database is read-only", timeout=30)
        await asyncio.sleep(3)  # the claim loops' retries meanwhile: said once per process
        assert proc.log().count("the database is read-only (") == workers, proc.log()
        await _read_only(database_url, False)
        await enqueue_many(database_url, 3)
        await receiver.wait_for(3, timeout=30)
        await wait_until(lambda: is_ready(port), timeout=30, what="ready again")
        codes = await stop_processes([proc])
    finally:
        await stop_processes([proc])
        await _read_only(database_url, False)
    assert codes == [0], proc.log()
    assert tracebacks(proc.log()) == 0, proc.log()
    assert "the database accepts writes again" in proc.log()


@pytest.mark.parametrize("workers", [1, 2])
async def test_readyz_names_each_host_when_every_host_of_the_url_fails(
    workers: int,
    database_url: str,
    redis_url: str,
    prefix: str,
    receiver: Receiver,
    tmp_path: Path,
) -> None:
    """A failover seen through a multi-host URL with target_session_attrs=read-write: the
    first host refuses connections, the other answers read-only, so no connection is made
    at all. /readyz says why for each host, as the commands do ("every host failed: ..."),
    not just "database unreachable (OperationalError)"; and no password."""
    parts = urlsplit(database_url)
    password = parts.password or "pw-not-shown"  # a server that trusts loopback ignores it
    refused = free_port()
    hosts = f"127.0.0.1:{refused},{parts.hostname}:{parts.port or 5432}"
    url = urlunsplit(
        parts._replace(
            netloc=f"{parts.username or 'postgres'}:{password}@{hosts}",
            query="target_session_attrs=read-write&connect_timeout=5",
        )
    )
    port = free_port()
    env = dispatcher_env(
        url, redis_url, receiver.url, prefix,
        WEBHOOK_METRICS_PORT=str(port), WEBHOOK_WORKERS=str(workers),
    )  # fmt: skip
    proc = await start_dispatcher(env, tmp_path / "dispatcher.log")
    try:
        await wait_ready(proc, timeout=30)
        await wait_until(lambda: is_ready(port), timeout=30, what="ready")
        await _read_only(database_url, True)
        status, body = await get_json(port, "/readyz")
        assert status == 503, body
        assert body["reason"] == (
            f"database unreachable (every host failed: 127.0.0.1:{refused} (Connection"
            f" refused); {parts.hostname}:{parts.port or 5432} (session is read-only))"
        ), body
        assert password not in json.dumps(body), body
        await _read_only(database_url, False)
        await wait_until(lambda: is_ready(port), timeout=30, what="ready again")
        codes = await stop_processes([proc])
    finally:
        await stop_processes([proc])
        await _read_only(database_url, False)
    assert codes == [0], proc.log()
    assert tracebacks(proc.log()) == 0, proc.log()
    assert password not in proc.log()
