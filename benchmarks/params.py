"""What a batch's completion statement costs by how its arrays are sent.

    python benchmarks/params.py [--admin-url URL] [--rounds N] [--results DIR]

The completion statement of a batch (``outbox.complete_statement``, its whole form) takes
fifteen arrays of per-row values. Two ways, alternating for ``--rounds`` rounds, for
batches of 10 and 100 delivered rows, with and without partition times:

- ``lists``: each array a Python list, dumped by psycopg element by element (what the
  dispatcher sent before ``pgarray``).
- ``literals``: each array one string joined by ``fluxora_webhooks.pgarray``, cast by the
  statement (what it sends now).

Prints, per statement: the client's CPU to build and dump the parameters alone, then the
client's and the backend's CPU to run it (on ids no row has: nothing is written, so what
is measured is the statement with its parameters), and keeps them as JSON in
``--results``. A scratch database on the server of ``--admin-url``, dropped at the end.
Loopback only; bounded loops.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import psycopg  # noqa: E402
from benchlib import keep, process_cpu_s  # noqa: E402
from psycopg import sql  # noqa: E402
from psycopg.adapt import PyFormat, Transformer  # noqa: E402

from fluxora_webhooks.migrations import migrate  # noqa: E402
from fluxora_webhooks.outbox import Completion, Outcome, complete_statement  # noqa: E402
from fluxora_webhooks.queries import native  # noqa: E402

DATABASE = "fluxora_bench_params"
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def completions(n: int) -> list[Completion]:
    return [
        Completion(10**12 + i, Outcome.DELIVERED, status_code=200, duration_ms=1.5 + i,
                   endpoint_id="ep_bench")
        for i in range(n)
    ]  # fmt: skip


def as_lists(batch: list[Completion], parts: dict[int, datetime | None]) -> tuple[str, list[Any]]:
    """The statement with its arrays as Python lists (the way before pgarray)."""
    text, names = native("complete_batch")
    known = [at for at in parts.values() if at is not None]
    by_name: dict[str, Any] = {
        "ids": [c.id for c in batch],
        "outcomes": [c.outcome.value for c in batch],
        "delays": [c.delay_ms for c in batch],
        "codes": [c.status_code for c in batch],
        "errors": [c.error for c in batch],
        "bodies": [c.response_body for c in batch],
        "durations": [c.duration_ms for c in batch],
        "reasons": [c.reason for c in batch],
        "endpoints": [c.endpoint_id for c in batch],
        "leases": [c.lease for c in batch],
        "parts": [parts[c.id] for c in batch],
        "part_lo": min(known, default=EPOCH),
        "part_hi": max(known, default=EPOCH),
        "route": [],
        "prerouted": [],
        "succeeded": ["ep_bench"],
        "failed": [],
    }
    return text, [by_name[n] for n in names]


def as_literals(
    batch: list[Completion], parts: dict[int, datetime | None]
) -> tuple[str, list[Any]]:
    """The statement as the dispatcher sends it (the whole form, as ``lists`` sends it)."""
    return complete_statement(batch, parts, succeeded=["ep_bench"], general=True)


WAYS = {"lists": as_lists, "literals": as_literals}


async def measure_all(args: argparse.Namespace, url: str) -> list[dict[str, Any]]:
    conn = await psycopg.AsyncConnection.connect(url, autocommit=True)
    when = datetime.now(UTC)
    runs: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        for size in (10, 100):
            for timed in (False, True):
                batch = completions(size)
                parts = {c.id: (when if timed else None) for c in batch}
                for way, build in WAYS.items():
                    n = args.statements
                    c0 = time.process_time()
                    for _ in range(n):
                        _, params = build(batch, parts)
                        Transformer(conn).dump_sequence(params, [PyFormat.AUTO] * len(params))
                    dump_us = 1e6 * (time.process_time() - c0) / n
                    text, params = build(batch, parts)
                    cur = psycopg.AsyncRawCursor(conn)
                    for _ in range(20):  # past psycopg's prepare threshold and plan choice
                        await cur.execute(text, params)
                    c0, s0 = time.process_time(), process_cpu_s(conn.info.backend_pid)
                    for _ in range(n):
                        text, params = build(batch, parts)
                        await cur.execute(text, params)
                        await cur.fetchall()
                    c1, s1 = time.process_time(), process_cpu_s(conn.info.backend_pid)
                    runs.append({
                        "round": round_ + 1, "rows": size, "partition_times": timed, "way": way,
                        "build_dump_us": dump_us,
                        "client_us": 1e6 * (c1 - c0) / n, "database_us": 1e6 * (s1 - s0) / n,
                    })  # fmt: skip
    await conn.close()
    return runs


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    async with await psycopg.AsyncConnection.connect(args.admin_url, autocommit=True) as admin:
        await admin.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(DATABASE)))
        await admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DATABASE)))
        url = psycopg.conninfo.make_conninfo(admin.info.dsn, dbname=DATABASE)
        try:
            async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
                await migrate(conn)
            return await measure_all(args, url)
        finally:
            await admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(DATABASE))
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--admin-url", default=os.environ.get("ADMIN_DATABASE_URL", "dbname=postgres")
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--statements", type=int, default=1000)
    parser.add_argument("--results", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    runs = asyncio.run(run(args))
    print("| round | rows | partition times | way | build + dump (us) | client CPU (us) |"
          " database CPU (us) |")  # fmt: skip
    print("|---:|---:|---|---|---:|---:|---:|")
    for r in runs:
        print(
            f"| {r['round']} | {r['rows']} | {'yes' if r['partition_times'] else 'no'} |"
            f" {r['way']} | {r['build_dump_us']:,.0f} | {r['client_us']:,.0f} |"
            f" {r['database_us']:,.0f} |"
        )
    keep(args.results, "params", {"statements": args.statements, "runs": runs})


if __name__ == "__main__":
    main()
