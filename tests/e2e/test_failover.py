"""PostgreSQL failover (SPEC section 16): with a multi-host ``DATABASE_URL`` and
``target_session_attrs=read-write``, dispatchers follow a promoted synchronous standby
within 10 s, and every event whose commit was acknowledged is delivered."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from aiohttp import web

from fluxora_webhooks import endpoints
from fluxora_webhooks.migrations import migrate
from tests.support.chaos import stop_processes, tracebacks, wait_ready
from tests.support.dispatch import wait_until
from tests.support.procs import DispatcherProcess, dispatcher_env, free_port, start_dispatcher
from tests.support.receiver import Received, Receiver
from tests.support.replication import ReplicatedPostgres, make_synchronous
from tests.support.scrape import get_json, is_ready

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# Long enough that every back-off of the dispatchers (claim loops, pool, LISTEN) reaches its
# cap before the standby is promoted: the bound must hold after any outage.
OUTAGE_S = 8.0
CONTINUE_WITHIN_S = 10.0


@pytest.fixture
def pair() -> Iterator[tuple[ReplicatedPostgres, ReplicatedPostgres]]:
    primary, standby = ReplicatedPostgres(), ReplicatedPostgres()
    try:
        primary.init()
        primary.start()
        with psycopg.connect(primary.url(), autocommit=True) as conn:
            conn.execute("CREATE DATABASE fluxora")
        asyncio.run(_migrate(primary.url("fluxora")))
        standby.clone_from(primary)
        standby.start()
        make_synchronous(primary)
        yield primary, standby
    finally:
        primary.cleanup()
        standby.cleanup()


class Producer:
    """Commits one event at a time, as an application would, following the failover with the
    same multi-host URL; remembers which commits were acknowledged and when."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.acknowledged: dict[int, float] = {}
        self.failed = 0
        self.stopped = asyncio.Event()

    async def run(self) -> None:
        n = 0
        conn: psycopg.AsyncConnection[object] | None = None
        while not self.stopped.is_set():
            n += 1
            try:
                if conn is None or conn.closed:
                    conn = await psycopg.AsyncConnection.connect(self.url, autocommit=True)
                await conn.execute(
                    "INSERT INTO webhook_outbox (stream_id, event_type, payload)"
                    " VALUES (%s, 'stream.updated', jsonb_build_object('n', %s::int))",
                    (f"s-{n}", n),
                )
                self.acknowledged[n] = time.time()
            except psycopg.OperationalError:
                self.failed += 1  # not acknowledged: it may or may not have committed
                if conn is not None:
                    await conn.close()
                conn = None
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.01)
        if conn is not None:
            await conn.close()


async def insert_unwaited(url: str, n: int) -> None:
    """``n`` events from a producer that does not wait for the standby (its own choice)."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute("SET synchronous_commit = local")
        await conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload)"
            " SELECT 's-' || g, 'stream.updated', jsonb_build_object('n', g)"
            " FROM generate_series(1, %s) g",
            (n,),
        )


async def commit_waits(port: int) -> bool:
    """/readyz is 503 naming a commit that waits."""
    status, body = await get_json(port, "/readyz")
    return status == 503 and "a commit has waited" in str(body["reason"])


async def test_dispatchers_follow_a_promoted_synchronous_standby_losing_nothing_acknowledged(
    pair: tuple[ReplicatedPostgres, ReplicatedPostgres],
    redis_url: str,
    redis_prefix: str,
    receiver: Receiver,
    tmp_path: Path,
) -> None:
    primary, standby = pair
    url = (
        f"postgresql://postgres@127.0.0.1:{primary.port},127.0.0.1:{standby.port}/fluxora"
        "?target_session_attrs=read-write&connect_timeout=5"
    )

    async def respond(r: Received) -> web.Response:
        await asyncio.sleep(0.02)  # batches are in flight when the primary dies
        return web.Response(status=200)

    receiver.respond = respond
    env = dispatcher_env(
        url, redis_url, receiver.url, redis_prefix,
        WEBHOOK_BATCH_SIZE="5", WEBHOOK_CLAIM_LOOPS="2", WEBHOOK_POLL_INTERVAL_MS="1000",
    )  # fmt: skip
    procs = [await _started(env, tmp_path / f"dispatcher-{i}.log") for i in range(2)]
    producer = Producer(url)
    producing = asyncio.create_task(producer.run())
    try:
        await receiver.wait_for(100, timeout=30)
        primary.stop("immediate")  # a crash: no shutdown checkpoint, clients cut off
        await asyncio.sleep(OUTAGE_S)
        standby.promote()
        promoted = time.time()
        await asyncio.sleep(3)  # the producer keeps writing, now to the new primary
        producer.stopped.set()
        await producing

        async def all_acknowledged_received() -> bool:
            return set(producer.acknowledged) <= _numbers(receiver)

        await wait_until(all_acknowledged_received, timeout=30, what="every acknowledged event")
        await wait_until(lambda: _drained(url), timeout=30, what="nothing pending")
        codes = await stop_processes(procs)
    finally:
        producer.stopped.set()
        with contextlib.suppress(Exception):
            await producing
        await stop_processes(procs)

    logs = [p.log() for p in procs]
    assert codes == [0, 0], logs
    assert all(tracebacks(log) == 0 for log in logs), logs
    assert producer.failed > 0, "the producer never saw the outage"
    after = [n for n, at in producer.acknowledged.items() if at > promoted]
    assert after, "nothing was committed on the new primary"
    # Dispatchers continued on the new primary within the bound.
    first = min(r.at for r in receiver.received if r.at > promoted)
    assert first - promoted < CONTINUE_WITHIN_S, first - promoted
    # Nothing acknowledged is lost; nothing is left pending on the new primary.
    assert set(producer.acknowledged) <= _numbers(receiver)
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        row = await (
            await conn.execute(
                "SELECT count(*) FILTER (WHERE NOT processed),"
                " count(*) FILTER (WHERE outcome = 'delivered'), pg_is_in_recovery()"
                " FROM webhook_outbox"
            )
        ).fetchone()
    assert row is not None
    pending, delivered, in_recovery = row
    assert (pending, in_recovery) == (0, False)
    assert delivered >= len(producer.acknowledged)


def _numbers(receiver: Receiver) -> set[int]:
    return {int(json.loads(r.body)["n"]) for r in receiver.received}


async def _drained(url: str) -> bool:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        row = await (
            await conn.execute("SELECT count(*) FROM webhook_outbox WHERE NOT processed")
        ).fetchone()
    return row is not None and row[0] == 0


async def _migrate(url: str) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await migrate(conn)


async def _started(env: dict[str, str], log: Path) -> DispatcherProcess:
    """A dispatcher that is dispatching. On a loaded machine the freshly started cluster
    may not answer within the 5 s connect timeout: `run` then waits for it
    (WEBHOOK_STARTUP_WAIT_MS) instead of exiting."""
    proc = await start_dispatcher(env, log)
    await wait_ready(proc, timeout=60)
    return proc


@pytest.mark.parametrize("workers", ["1", "2"])
async def test_readyz_says_when_commits_do_not_complete_and_again_when_they_do(
    pair: tuple[ReplicatedPostgres, ReplicatedPostgres],
    redis_url: str,
    redis_prefix: str,
    receiver: Receiver,
    tmp_path: Path,
    workers: str,
) -> None:
    """The synchronous standby stops answering: every commit on the primary waits, nothing
    fails, and the dispatchers deliver the claimed events but cannot record them. /readyz
    (one process's; the supervisor's of two workers) turns 503 naming the waiting commit
    once one has waited 10 s, and 200 again once the standby is back and the commits
    complete. The commits that wait behind the first one's lock on the outbox's wake-up
    (those of batches that routed deliveries of a registered endpoint) wait too: none gives
    up after the session's lock timeout to send its batch again, so every delivery arrives
    once however long the wait."""
    primary, standby = pair
    url = primary.url("fluxora")
    port = free_port()
    env = dispatcher_env(
        url, redis_url, receiver.url, redis_prefix,
        WEBHOOK_WORKERS=workers, WEBHOOK_METRICS_PORT=str(port), WEBHOOK_POLL_INTERVAL_MS="500",
        WEBHOOK_ALLOWED_NETWORKS="127.0.0.0/8",
    )  # fmt: skip
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await endpoints.create(
            conn,
            url=receiver.url + "&endpoint=registered",
            allowed_networks=[ipaddress.ip_network("127.0.0.0/8")],
        )
    proc = await start_dispatcher(env, tmp_path / "supervisor.log")
    try:
        await wait_until(lambda: is_ready(port), timeout=30, what="dispatching")
        standby.stop("fast")
        # The producer does not wait for the standby (its own choice); the dispatchers do.
        await insert_unwaited(url, 20)
        await receiver.wait_for(40, timeout=30)  # the built-in endpoint's and the other's

        await wait_until(
            lambda: commit_waits(port), timeout=40, what="/readyz naming the waiting commit"
        )
        await asyncio.sleep(5)  # past the session's lock timeout (10 s) for the later commits
        standby.start()
        await wait_until(lambda: is_ready(port), timeout=40, what="/readyz ready again")
        await wait_until(lambda: _drained(url), timeout=30, what="every delivery recorded")
        codes = await stop_processes([proc])
    finally:
        await stop_processes([proc])
    assert codes == [0], proc.log()
    if workers == "2":
        # Logged by the supervisor as a worker's commits stop and as they come back, not
        # every second in between.
        assert 1 <= proc.log().count("a commit has waited") <= 4, proc.log()
        assert "its commits complete again" in proc.log()
    assert tracebacks(proc.log()) == 0, proc.log()
    received = receiver.by_delivery()
    assert len(received) == 40
    assert {i: len(r) for i, r in received.items() if len(r) > 1} == {}  # none sent again


async def test_a_stop_while_a_commit_waits_does_not_say_the_commits_complete_again(
    pair: tuple[ReplicatedPostgres, ReplicatedPostgres],
    redis_url: str,
    redis_prefix: str,
    receiver: Receiver,
    tmp_path: Path,
) -> None:
    """SIGTERM while the synchronous standby does not answer: each worker's drain gives up
    on the batch whose commit waits (WEBHOOK_TIMEOUT_MS plus the grace) and PostgreSQL
    cancels that wait. The commits never completed again, so the supervisor must not log
    that they did: the last it says of them is that one waits. Nothing is sent twice."""
    primary, standby = pair
    url = primary.url("fluxora")
    port = free_port()
    env = dispatcher_env(
        url, redis_url, receiver.url, redis_prefix,
        WEBHOOK_WORKERS="2", WEBHOOK_METRICS_PORT=str(port), WEBHOOK_TIMEOUT_MS="1000",
    )  # fmt: skip
    proc = await start_dispatcher(env, tmp_path / "supervisor.log")
    try:
        await wait_until(lambda: is_ready(port), timeout=30, what="dispatching")
        standby.stop("fast")
        await insert_unwaited(url, 5)
        await receiver.wait_for(5, timeout=30)

        await wait_until(
            lambda: commit_waits(port), timeout=40, what="/readyz naming the waiting commit"
        )
        codes = await stop_processes([proc])
    finally:
        await stop_processes([proc])
    log = proc.log()
    assert codes == [0], log
    assert "abandoning the in-flight batch" in log, log  # the wait was cancelled
    assert "a commit has waited" in log, log
    assert "its commits complete again" not in log, log
    assert tracebacks(log) == 0, log
    assert {i: len(r) for i, r in receiver.by_delivery().items() if len(r) > 1} == {}


async def test_without_target_session_attrs_a_standby_is_named_once_until_promoted(
    pair: tuple[ReplicatedPostgres, ReplicatedPostgres],
    redis_url: str,
    redis_prefix: str,
    receiver: Receiver,
    tmp_path: Path,
) -> None:
    """A multi-host DATABASE_URL without target_session_attrs=read-write: once the primary
    dies, libpq connects to the standby, which accepts sessions and refuses every claim and
    every LISTEN. /readyz is 503 naming it, the log says it once with what to do (not a
    warning per claim loop's retry, nor "LISTEN connection lost" every few seconds), and
    once the standby is promoted the dispatcher claims again and delivers."""
    primary, standby = pair
    hosts = f"127.0.0.1:{primary.port},127.0.0.1:{standby.port}"
    url = f"postgresql://postgres@{hosts}/fluxora?connect_timeout=5"
    port = free_port()
    env = dispatcher_env(url, redis_url, receiver.url, redis_prefix, WEBHOOK_METRICS_PORT=str(port))
    proc = await start_dispatcher(env, tmp_path / "dispatcher.log")
    try:
        await wait_until(lambda: is_ready(port), timeout=30, what="dispatching")
        primary.stop("immediate")

        async def read_only() -> bool:
            status, body = await get_json(port, "/readyz")
            return status == 503 and "a standby in recovery" in str(body)

        await wait_until(read_only, timeout=40, what="/readyz naming the standby")
        await asyncio.sleep(8)  # the claim loops' and the listener's retries meanwhile
        log = proc.log()
        assert log.count("the database is read-only (a standby in recovery)") == 1, log
        assert "target_session_attrs=read-write" in log
        assert "LISTEN connection lost (ReadOnlySqlTransaction)" not in log
        assert "discarding closed connection" not in log.split("read-only (a standby")[1]
        standby.promote()
        async with await psycopg.AsyncConnection.connect(
            standby.url("fluxora"), autocommit=True
        ) as conn:
            await conn.execute(
                "INSERT INTO webhook_outbox (stream_id, event_type, payload)"
                " SELECT 's-' || g, 'stream.updated', jsonb_build_object('n', g)"
                " FROM generate_series(1, 3) g"
            )
        await receiver.wait_for(3, timeout=40)
        await wait_until(lambda: is_ready(port), timeout=40, what="ready again")
        codes = await stop_processes([proc])
    finally:
        await stop_processes([proc])
    assert codes == [0], proc.log()
    assert "the database accepts writes again" in proc.log()
    assert tracebacks(proc.log()) == 0, proc.log()
