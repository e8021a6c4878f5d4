"""What writing one fanned-out delivery costs PostgreSQL: routed as a pending row and then
completed (what the dispatcher does today: two row versions, neither update HOT), against
written once with its outcome (what a routing batch could do for the deliveries it sends
itself, were their rows inserted at its completion).

    .venv/bin/python benchmarks/fan_write.py [--database-url URL] [--database NAME]
                                             [--rounds N] [--batches N] [--results DIR]

``--database-url`` is an administrative connection (default ``$DATABASE_URL`` or
``dbname=postgres``); the benchmark creates its own scratch database (``--database``,
default ``fan_write_bench``), migrates it with the project's own ``migrate`` (every index
of the outbox as a deployment has it), and drops it at the end, also on error.

Each batch is one transaction of 100 delivery rows of one tenant to 100 endpoints (a
payload of about 200 bytes, as the benchmarks' events): ``pending_then_completed`` inserts
them unprocessed and then marks them delivered by id (the columns ``complete_batch`` sets
for a delivered row); ``written_once`` inserts them delivered. The two shapes alternate
within each round (the order rotates) and the table is vacuumed after each window. Per
row: the backend's CPU (``/proc/<pid>/stat``), the wall time and the WAL written. Prints a
table and keeps ``<results>/fan-write-<timestamp>.json``. Loopback only; bounded loops.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import psycopg
from benchlib import PAD, keep, process_cpu_s, run, scratch_database

from fluxora_webhooks.migrations import migrate

ROWS = 100  # per batch: a routing batch of one event to 100 endpoints
SHAPES = ("pending_then_completed", "written_once")
COLUMNS = "tenant, stream_id, event_type, payload, endpoint_id, event_id"
SOURCE = (
    "SELECT 'acme', 's-' || g, 'order.paid', %(payload)s::jsonb, 'ep_' || (g %% 100),"
    " %(event)s::bigint"
)
INSERT_PENDING = (
    f"INSERT INTO webhook_outbox ({COLUMNS}) {SOURCE} FROM generate_series(1, %(n)s) g RETURNING id"
)
COMPLETE = (
    "UPDATE webhook_outbox SET processed = true, processed_at = now(), outcome = 'delivered',"
    " status_code = 200, duration_ms = 1.5, error = NULL, response_body = NULL"
    " WHERE id = ANY(%(ids)s::bigint[])"
)
INSERT_DONE = (
    f"INSERT INTO webhook_outbox ({COLUMNS}, processed, processed_at, outcome, status_code,"
    f" duration_ms) {SOURCE}, true, now(), 'delivered', 200, 1.5"
    " FROM generate_series(1, %(n)s) g"
)


async def window(conn: psycopg.AsyncConnection[Any], shape: str, batches: int) -> dict[str, Any]:
    params: dict[str, Any] = {"payload": f'{{"kind": "bench", "pad": "{PAD}"}}', "n": ROWS}
    pid = conn.info.backend_pid
    lsn = (await (await conn.execute("SELECT pg_current_wal_insert_lsn()")).fetchone() or [""])[0]
    cpu, started = process_cpu_s(pid), time.perf_counter()
    for batch in range(batches):
        params["event"] = batch
        async with conn.transaction():
            if shape == "pending_then_completed":
                cur = await conn.execute(INSERT_PENDING, params)
                ids = [row[0] for row in await cur.fetchall()]
                await conn.execute(COMPLETE, {"ids": ids})
            else:
                await conn.execute(INSERT_DONE, params)
    wall = time.perf_counter() - started
    cpu = process_cpu_s(pid) - cpu
    cur = await conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %s)", (lsn,))
    wal = float((await cur.fetchone() or [0])[0])
    await conn.execute("VACUUM webhook_outbox")
    rows = ROWS * batches
    return {
        "shape": shape,
        "backend_cpu_us_per_row": cpu / rows * 1e6,
        "wall_us_per_row": wall / rows * 1e6,
        "wal_bytes_per_row": wal / rows,
    }


async def measure(url: str, rounds: int, batches: int) -> dict[str, Any]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await migrate(conn)
        cur = await conn.execute(
            "SELECT count(*) FROM pg_indexes WHERE tablename = 'webhook_outbox'"
        )
        indexes = int((await cur.fetchone() or [0])[0])
        runs = []
        for shape in SHAPES:  # a warm-up window each, not kept
            await window(conn, shape, max(1, batches // 10))
        for r in range(rounds):
            for shape in SHAPES if r % 2 == 0 else tuple(reversed(SHAPES)):
                runs.append({"round": r, **await window(conn, shape, batches)})
        cur = await conn.execute("SELECT count(*) FROM webhook_outbox WHERE NOT processed")
        pending = int((await cur.fetchone() or [0])[0])
    return {"rows_per_batch": ROWS, "outbox_indexes": indexes, "runs": runs, "pending": pending}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--database-url", default=os.environ.get("DATABASE_URL", "dbname=postgres"))
    parser.add_argument("--database", default="fan_write_bench", help="the scratch database")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=200, help="per shape and round")
    parser.add_argument("--results", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    if args.rounds < 1 or args.batches < 1:
        parser.error("--rounds and --batches must be at least 1")
    with scratch_database(args.database_url, args.database) as url:
        out = run(measure(url, args.rounds, args.batches))
    print(f"\n{ROWS} delivery rows per transaction, {out['outbox_indexes']} outbox indexes\n")
    print("| shape | backend CPU us/row | wall us/row | WAL bytes/row | rounds (CPU) |")
    print("|---|---:|---:|---:|---|")
    medians: dict[str, dict[str, float]] = {}
    for shape in SHAPES:
        mine = [r for r in out["runs"] if r["shape"] == shape]
        medians[shape] = {
            key: statistics.median(r[key] for r in mine)
            for key in ("backend_cpu_us_per_row", "wall_us_per_row", "wal_bytes_per_row")
        }
        m = medians[shape]
        each = " / ".join(f"{r['backend_cpu_us_per_row']:.1f}" for r in mine)
        print(
            f"| {shape} | {m['backend_cpu_us_per_row']:.1f} | {m['wall_us_per_row']:.1f}"
            f" | {m['wal_bytes_per_row']:,.0f} | {each} |"
        )
    once, twice = medians["written_once"], medians["pending_then_completed"]
    print(
        f"\nwritten once / pending then completed: backend CPU"
        f" {once['backend_cpu_us_per_row'] / twice['backend_cpu_us_per_row']:.2f},"
        f" WAL {once['wal_bytes_per_row'] / twice['wal_bytes_per_row']:.2f}"
    )
    out["medians"] = medians
    keep(args.results, "fan-write", out)
    if out["pending"]:
        raise SystemExit(f"check failed: {out['pending']} rows left pending")


if __name__ == "__main__":
    main()
