"""WAL and storage per delivery, for capacity planning (``docs/scaling.md``).

    .venv/bin/python benchmarks/wal_per_delivery.py [--events 10000] [--batches 10,100]

On a PostgreSQL of its own (a temporary cluster on a free port, default settings apart
from fsync, which changes no WAL volume; WAL is cluster-wide, so a shared server would
count other people's writes), for each batch size: a producer commits ``--events``
events, one transaction each as an application would; then a real ``fluxora-webhooks
run`` (one process) delivers them to a loopback consumer that answers 200. It prints, per
event, the WAL the producer wrote, the WAL the dispatcher wrote (``pg_current_wal_lsn()``
before and after, autovacuum included), the full-page images in it (``pg_stat_wal``; the
run starts right after a checkpoint, so every page it touches pays one: the high side),
and the outbox's size on disk (table, TOAST and indexes) per processed row, and the CPU the
server and the dispatcher process used per event in each phase; then the WAL
of the VACUUM that follows the deliveries and of retention (``prune``'s DELETE and the
VACUUM after it), which every delivered row costs in the end too.

Needs the PostgreSQL server binaries (``initdb``, ``pg_ctl``) and Redis as the tests do.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
import psycopg  # noqa: E402
from tests.support import engines  # noqa: E402
from tests.support.chaos import wait_ready  # noqa: E402
from tests.support.procs import dispatcher_env, start_dispatcher  # noqa: E402
from tests.support.receiver import Receiver  # noqa: E402
from tests.support.replication import ReplicatedPostgres  # noqa: E402

from fluxora_webhooks.migrations import migrate  # noqa: E402
from fluxora_webhooks.retention import prune  # noqa: E402

WAL_STATS = "SELECT pg_current_wal_lsn(), wal_records, wal_fpi FROM pg_stat_wal"


def server_cpu_s(server: ReplicatedPostgres) -> float:
    """CPU seconds used by the whole server so far: the postmaster, its live children, and
    (through the postmaster's reaped-children counters) the backends that exited."""
    postmaster = psutil.Process(int((server.data / "postmaster.pid").read_text().split()[0]))
    t = postmaster.cpu_times()
    total = t.user + t.system + t.children_user + t.children_system
    for child in postmaster.children():
        with contextlib.suppress(psutil.NoSuchProcess):
            c = child.cpu_times()
            total += c.user + c.system
    return total


async def _one(conn: psycopg.AsyncConnection[Any], sql: str) -> Any:
    row = await (await conn.execute(sql)).fetchone()
    assert row is not None
    return row


async def measure(server: ReplicatedPostgres, batch: int, events: int) -> dict[str, float]:
    dbname = f"wal_b{batch}"
    async with await psycopg.AsyncConnection.connect(server.url(), autocommit=True) as admin:
        await admin.execute(f"CREATE DATABASE {dbname}")
    url = server.url(dbname)
    receiver = Receiver()
    await receiver.start()
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await migrate(conn)
        env = dispatcher_env(
            url, engines.redis_url(), receiver.url, f"wal-{time.time_ns()}:",
            WEBHOOK_BATCH_SIZE=str(batch), WEBHOOK_CLAIM_LOOPS="4",
        )  # fmt: skip
        proc = await start_dispatcher(env, server.folder / f"dispatcher-{batch}.log")
        try:
            # Started, then paused while the producer writes: its start-up is not counted,
            # and the two phases' WAL and CPU stay apart.
            await wait_ready(proc)
            await asyncio.sleep(1)
            dispatcher = psutil.Process(proc.pid)
            dispatcher.suspend()
            cpu_d0 = sum(dispatcher.cpu_times()[:2])
            await conn.execute("CHECKPOINT")
            lsn0, *_ = await _one(conn, WAL_STATS)
            cpu0 = server_cpu_s(server)
            for n in range(events):  # one committed transaction per event
                await conn.execute(
                    "INSERT INTO webhook_outbox (stream_id, event_type, payload)"
                    " VALUES (%s, 'stream.updated', jsonb_build_object('id', %s::text,"
                    " 'status', 'paused', 'n', %s::int))",
                    (f"stream-{n}", f"stream-{n}", n),
                )
            lsn1, records1, fpi1 = await _one(conn, WAL_STATS)
            cpu1 = server_cpu_s(server)
            started = time.monotonic()
            dispatcher.resume()
            while (await _one(conn, "SELECT count(*) FROM webhook_outbox WHERE NOT processed"))[0]:
                if proc.proc.returncode is not None or time.monotonic() - started > 600:
                    raise RuntimeError(f"the dispatcher did not deliver:\n{proc.log()[-2000:]}")
                await asyncio.sleep(0.2)
            took = time.monotonic() - started
            lsn2, records2, fpi2 = await _one(conn, WAL_STATS)
            cpu2 = server_cpu_s(server)
            dispatcher_cpu = sum(dispatcher.cpu_times()[:2]) - cpu_d0
        finally:
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(proc.pid).resume()
            proc.terminate()
            await proc.wait(30)
            await receiver.stop()
        (size,) = await _one(conn, "SELECT pg_total_relation_size('webhook_outbox')")
        # What autovacuum does after the deliveries (the old row versions), then what
        # retention does once the rows are old enough (DELETE, and the vacuum after it).
        await conn.execute("VACUUM webhook_outbox")
        lsn3, *_ = await _one(conn, WAL_STATS)
        await asyncio.sleep(0.01)
        await prune(conn, older_than_ms=1, batch_size=5000)
        await conn.execute("VACUUM webhook_outbox")
        lsn4, *_ = await _one(conn, WAL_STATS)
        wal = [
            float((await _one(conn, f"SELECT pg_wal_lsn_diff('{b}', '{a}')"))[0]) / events
            for a, b in ((lsn0, lsn1), (lsn1, lsn2), (lsn2, lsn3), (lsn3, lsn4))
        ]
    return {
        "batch": batch,
        "events": events,
        "enqueue_wal_per_event": wal[0],
        "dispatch_wal_per_event": wal[1],
        "vacuum_wal_per_event": wal[2],
        "retention_wal_per_event": wal[3],
        "enqueue_pg_cpu_us": (cpu1 - cpu0) / events * 1e6,
        "dispatch_pg_cpu_us": (cpu2 - cpu1) / events * 1e6,
        "dispatcher_cpu_us": dispatcher_cpu / events * 1e6,
        "dispatch_records_per_event": (records2 - records1) / events,
        "dispatch_fpi_per_event": (fpi2 - fpi1) / events,
        "outbox_bytes_per_row": float(size) / events,
        "deliveries_per_s": events / took,
    }


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=10_000)
    parser.add_argument("--batches", default="10,100")
    args = parser.parse_args()
    server = ReplicatedPostgres()
    try:
        server.init()
        server.start()
        results = [await measure(server, int(b), args.events) for b in args.batches.split(",")]
    finally:
        server.cleanup()
    print("| batch | PostgreSQL CPU/event: producer | dispatcher | dispatcher process CPU/event |")
    print("|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['batch']} | {r['enqueue_pg_cpu_us']:,.0f} µs | {r['dispatch_pg_cpu_us']:,.0f} µs"
            f" | {r['dispatcher_cpu_us']:,.0f} µs |"
        )
    print()
    print(
        "| batch | events | WAL/event: producer | dispatcher | vacuum after | retention"
        " (DELETE + vacuum) | dispatcher WAL records/event | full-page images/event"
        " | outbox on disk/row | deliveries/s |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['batch']} | {r['events']:,} | {r['enqueue_wal_per_event']:,.0f} B"
            f" | {r['dispatch_wal_per_event']:,.0f} B | {r['vacuum_wal_per_event']:,.0f} B"
            f" | {r['retention_wal_per_event']:,.0f} B | {r['dispatch_records_per_event']:.1f}"
            f" | {r['dispatch_fpi_per_event']:.2f} | {r['outbox_bytes_per_row']:,.0f} B"
            f" | {r['deliveries_per_s']:,.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
