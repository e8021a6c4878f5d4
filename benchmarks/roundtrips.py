"""What one claim transaction's round trips cost, client and database, by how they are sent.

    python benchmarks/roundtrips.py [--database-url URL] [--rounds N] [--results DIR]

A claim-shaped transaction (lock ten rows, update them from arrays of per-row values,
commit) four ways, on one connection, alternating for ``--rounds`` rounds:

- ``separate``: as the dispatcher sends it today: ``BEGIN``, the claim, the completion and
  ``COMMIT``, each its own round trip (extended protocol, psycopg's prepared statements).
- ``pipeline``: the completion, ``COMMIT``, ``BEGIN`` and the next claim in psycopg's
  pipeline mode (one flush, one sync).
- ``fused``: the same four in one simple-protocol message, the two statements SQL
  ``PREPARE``d once and run by ``EXECUTE`` with client-side literals.
- ``commit_begin``: the claim and the completion as ``separate`` sends them, then
  ``COMMIT; BEGIN`` as one simple-protocol message: three round trips, the next
  transaction begun by the one that ends this one.

Prints the client's CPU, the backend's CPU (``/proc/<pid>/stat``) and the wall time per
transaction, and keeps them as JSON in ``--results``. Loopback only; bounded loops.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import psycopg
from benchlib import keep, process_cpu_s

CLAIM = "SELECT id, v, now() AS at, 'abc'::text AS t FROM rt WHERE id <= %(n)s FOR UPDATE"
COMPLETE = (
    "UPDATE rt SET v = v + 1 FROM unnest(%(ids)s::int8[], %(codes)s::int4[], %(errs)s::text[])"
    " AS u(id, c, e) WHERE rt.id = u.id"
)
PARAMS: dict[str, Any] = {
    "n": 10,
    "ids": list(range(1, 11)),
    "codes": [200] * 10,
    "errs": [None] * 10,
}


async def measure_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    conn = await psycopg.AsyncConnection.connect(args.database_url, autocommit=True)
    await conn.execute("CREATE TEMP TABLE rt (id int8 PRIMARY KEY, v int)")
    await conn.execute("INSERT INTO rt SELECT g, 0 FROM generate_series(1, 100) g")
    await conn.execute(
        "PREPARE rt_claim(int) AS SELECT id, v, now() AS at, 'abc'::text AS t"
        " FROM rt WHERE id <= $1 FOR UPDATE"
    )
    await conn.execute(
        "PREPARE rt_complete(int8[], int4[], text[]) AS UPDATE rt SET v = v + 1"
        " FROM unnest($1, $2, $3) AS u(id, c, e) WHERE rt.id = u.id"
    )
    fused_cur = psycopg.AsyncClientCursor(conn)

    async def separate() -> None:
        async with conn.transaction():
            cur = await conn.execute(CLAIM, PARAMS)
            await cur.fetchall()
            await conn.execute(COMPLETE, PARAMS)

    async def pipeline() -> None:
        async with conn.pipeline():
            await conn.execute(COMPLETE, PARAMS)
            await conn.execute("COMMIT")
            await conn.execute("BEGIN")
            cur = await conn.execute(CLAIM, PARAMS)
        await cur.fetchall()

    async def fused() -> None:
        await fused_cur.execute(
            "EXECUTE rt_complete(%(ids)s, %(codes)s, %(errs)s); COMMIT; BEGIN;"
            " EXECUTE rt_claim(%(n)s)",
            PARAMS,
        )
        while fused_cur.nextset():
            pass
        await fused_cur.fetchall()

    async def commit_begin() -> None:
        cur = await conn.execute(CLAIM, PARAMS)
        await cur.fetchall()
        await conn.execute(COMPLETE, PARAMS)
        await conn.execute("COMMIT; BEGIN")

    async def measure(step: Callable[[], Awaitable[None]], open_tx: bool) -> dict[str, float]:
        if open_tx:  # the others commit the transaction the previous one began
            await conn.execute("BEGIN")
        for _ in range(100):
            await step()
        n = args.transactions
        c0, s0, w0 = time.process_time(), process_cpu_s(conn.info.backend_pid), time.perf_counter()
        for _ in range(n):
            await step()
        c1, s1, w1 = time.process_time(), process_cpu_s(conn.info.backend_pid), time.perf_counter()
        if open_tx:
            await conn.execute("COMMIT")
        return {
            "client_us": 1e6 * (c1 - c0) / n,
            "database_us": 1e6 * (s1 - s0) / n,
            "wall_us": 1e6 * (w1 - w0) / n,
        }

    ways = {
        "separate": (separate, False),
        "pipeline": (pipeline, True),
        "fused": (fused, True),
        "commit_begin": (commit_begin, True),
    }
    runs: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        for name, (step, open_tx) in ways.items():
            runs.append({"round": round_ + 1, "way": name, **await measure(step, open_tx)})
    await conn.close()
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--database-url", default=os.environ.get("DATABASE_URL", "dbname=test"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--transactions", type=int, default=2000)
    parser.add_argument("--results", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    try:
        import uvloop

        runs = uvloop.run(measure_all(args))
    except ImportError:
        runs = asyncio.run(measure_all(args))
    print("| round | way | client CPU (us) | database CPU (us) | wall (us) |")
    print("|---:|---|---:|---:|---:|")
    for r in runs:
        print(
            f"| {r['round']} | {r['way']} | {r['client_us']:,.0f} | {r['database_us']:,.0f} |"
            f" {r['wall_us']:,.0f} |"
        )
    keep(args.results, "roundtrips", {"transactions": args.transactions, "runs": runs})


if __name__ == "__main__":
    main()
