"""PostgreSQL trouble: a server restarted (and crashed) mid-run, and connections killed with
``pg_terminate_backend`` again and again. The dispatchers reconnect with backoff, nothing
is lost, and there is no crash loop: the same processes are alive afterwards, with no
traceback in their logs, and they stop cleanly.

The restart uses a PostgreSQL of the test's own (:class:`OwnPostgres`); the terminations
hit only the backends of the test's own database on the shared cluster.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

from fluxora_webhooks.migrations import migrate
from tests.support.chaos import (
    ChaosConsumer,
    OwnPostgres,
    account,
    dbname_of,
    enqueue_events,
    format_table,
    own_postgres_running,
    stop_processes,
    terminate_backends,
    tracebacks,
    wait_ready,
)
from tests.support.dispatch import pending, wait_until
from tests.support.procs import DispatcherProcess, dispatcher_env, start_dispatcher

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

UNAVAILABLE = "database unavailable"
# Long enough for an uncapped doubling backoff (1, 2, 4, ... s) to overshoot by far.
OUTAGE_S = 35
RESUME_BOUND_S = 15
# A stop during the outage waits out a pending connection request (up to 5 s) first.
TIMEOUT_S, DRAIN_GRACE_S = 5, 5
ABANDONED = "abandoning the in-flight batch"  # the service's log line when the bound is hit


@pytest.fixture
def own_postgres() -> Iterator[OwnPostgres]:
    with own_postgres_running() as pg:
        yield pg


async def _alive(procs: list[DispatcherProcess]) -> None:
    for p in procs:
        assert p.proc.returncode is None, f"dispatcher {p.pid} died:\n{p.log()}"


async def _more(consumer: ChaosConsumer, seen: int) -> bool:
    return len(consumer.hits) > seen


async def _settled(database_url: str) -> bool:
    """No pending row (a connection error while looking counts as "not yet")."""
    try:
        return await pending(database_url) == 0
    except psycopg.OperationalError:
        return False


async def test_postgres_restarted_and_crashed_mid_run(
    own_postgres: OwnPostgres, redis_url: str, redis_prefix: str, tmp_path: Path
) -> None:
    admin = own_postgres.url()
    async with await psycopg.AsyncConnection.connect(admin, autocommit=True) as conn:
        await conn.execute("CREATE DATABASE chaos")
    database_url = own_postgres.url("chaos")
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await migrate(conn)
    consumer = ChaosConsumer(ok_delay_s=0.02)
    await consumer.start()
    # A long poll interval: once idle, only a NOTIFY on a re-established LISTEN wakes them.
    env = dispatcher_env(
        database_url, redis_url, consumer.url, redis_prefix,
        WEBHOOK_BATCH_SIZE="10", WEBHOOK_CLAIM_LOOPS="2", WEBHOOK_POLL_INTERVAL_MS="60000",
        WEBHOOK_TIMEOUT_MS=str(TIMEOUT_S * 1000),
    )  # fmt: skip
    procs = [await start_dispatcher(env, tmp_path / f"dispatcher-{i}.log") for i in range(3)]
    events = 1500
    try:
        for proc in procs:  # started (schema checked) before the database goes away
            await wait_ready(proc)
        await enqueue_events(database_url, ["ok"] * events)
        await consumer.wait_for(300)
        own_postgres.restart("fast")  # every connection is cut mid-batch
        await consumer.wait_for(800, timeout=60)
        own_postgres.stop("immediate")  # a crash: recovery on the next start
        down = time.monotonic()
        await asyncio.sleep(OUTAGE_S / 2)  # the dispatchers retry with backoff meanwhile
        await _alive(procs)
        # SIGTERM while the database is away: nothing is in flight, so it exits at once
        # (within the drain bound), rather than finishing a backoff sleep first.
        leaving = procs.pop()
        assert await stop_processes([leaving], TIMEOUT_S + DRAIN_GRACE_S) == [0], leaving.log()
        assert ABANDONED not in leaving.log() and tracebacks(leaving.log()) == 0
        await asyncio.sleep(down + OUTAGE_S - time.monotonic())
        await _alive(procs)
        seen = len(consumer.hits)
        own_postgres.start()
        back = time.monotonic()
        await wait_until(
            lambda: _more(consumer, seen), timeout=60, what="deliveries after the restart"
        )
        resumed = time.monotonic() - back
        await wait_until(lambda: _settled(database_url), timeout=90, what="all delivered")
        print(f"\ndeliveries resumed {resumed:.1f}s after a {OUTAGE_S}s outage")
        # The reconnect backoff is capped (at 5 s): however long the outage, deliveries
        # resume within seconds of PostgreSQL's return, not after a doubled-up wait.
        assert resumed < RESUME_BOUND_S, resumed
        # Idle now: a new event is picked up through the re-established LISTEN.
        await enqueue_events(database_url, ["ok"] * 20, first_n=events + 1)
        await wait_until(lambda: _settled(database_url), timeout=30, what="woken by NOTIFY")
        await _alive(procs)
    finally:
        codes = await stop_processes(procs)
        await consumer.stop()
    logs = [p.log() for p in procs]
    assert codes == [0, 0], logs
    assert all(tracebacks(log) == 0 for log in logs), logs
    # Each loop whose claims failed says when it claims again (an operator's "it is back").
    assert any("claiming again (" in log for log in logs), logs
    # They noticed, and backed off: a handful of warnings per outage, not a hot loop.
    noticed = [log.count(UNAVAILABLE) for log in logs]
    assert all(0 < n < 60 for n in noticed), noticed
    # The pool's and the listener's reconnects are said once per outage, not per try: a
    # restart and a crash, each at most once a minute per kind (the pool's repeats are
    # counted on its next line), and the listener says when it is back.
    pool_lines = [log.count("error connecting in") for log in logs]
    listen_lines = [log.count("LISTEN connection lost") for log in logs]
    print(f"pool warnings {pool_lines}, LISTEN lost {listen_lines}")
    assert all(n <= 4 for n in pool_lines), pool_lines
    assert all(1 <= n <= 2 for n in listen_lines), listen_lines
    assert all("LISTEN connection back (" in log for log in logs), logs
    accounting = await account(database_url, consumer)
    print(format_table(accounting))
    assert accounting.ok and accounting.lost == 0, accounting
    assert accounting.written == accounting.delivered == events + 20, accounting


async def test_backends_terminated_again_and_again(
    database_url: str,
    pg_admin_url: str,
    redis_url: str,
    redis_prefix: str,
    tmp_path: Path,
    record_property: Callable[[str, object], None],
) -> None:
    seed = int(os.environ.get("CHAOS_SEED") or random.randrange(2**32))
    rng = random.Random(seed)
    dbname = dbname_of(database_url)
    consumer = ChaosConsumer(ok_delay_s=0.1)
    await consumer.start()
    env = dispatcher_env(
        database_url, redis_url, consumer.url, redis_prefix,
        WEBHOOK_BATCH_SIZE="10", WEBHOOK_CLAIM_LOOPS="2", WEBHOOK_POLL_INTERVAL_MS="500",
    )  # fmt: skip
    events = 3000
    await enqueue_events(database_url, ["ok"] * events)
    procs = [await start_dispatcher(env, tmp_path / f"dispatcher-{i}.log") for i in range(2)]
    rounds = terminated = 0
    try:
        await consumer.wait_for(100)
        while rounds < 40 and (rounds < 20 or len(consumer.answered_2xx()) < events):
            await asyncio.sleep(rng.uniform(0.15, 0.4))
            terminated += await terminate_backends(pg_admin_url, dbname)
            rounds += 1
        await _alive(procs)
        await wait_until(lambda: _settled(database_url), timeout=90, what="all delivered")
        await _alive(procs)
    finally:
        codes = await stop_processes(procs)
        await consumer.stop()
    logs = [p.log() for p in procs]
    assert codes == [0, 0], logs
    assert all(tracebacks(log) == 0 for log in logs), logs
    accounting = await account(database_url, consumer)
    report = (
        f"seed={seed}: {rounds} rounds of pg_terminate_backend, {terminated} backends"
        f" terminated\n{format_table(accounting)}"
    )
    print("\n" + report)
    record_property("terminate_report", report)
    assert terminated >= rounds  # every round found dispatcher backends to kill
    assert accounting.ok and accounting.lost == 0, report
    assert accounting.written == accounting.delivered == events, report
