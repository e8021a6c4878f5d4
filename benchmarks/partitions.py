"""Claim time on a partitioned outbox (SPEC 16): 100 partitions holding 10 M processed rows,
against an ordinary outbox holding the same 10 M rows, and an empty one.

Each database gets the real schema (``migrate``; ``partitions.convert`` for the partitioned
one), the processed history is written in bulk and vacuumed (as autovacuum keeps it), a
few hundred rows are pending, and the design document's claim is timed in a claim
transaction that is rolled back (so the pending rows stay): p50, p99 and the ratio to the
empty outbox. Prints a table and saves JSON under benchmarks/results/.

    python benchmarks/partitions.py [--rows 10000000] [--partitions 100] [--claims 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from fluxora_webhooks import partitions
from fluxora_webhooks.migrations import migrate
from fluxora_webhooks.outbox import claim_due

ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
HOUR = 3_600_000
RESULTS = Path(__file__).resolve().parent / "results"


def url_of(name: str) -> str:
    return ADMIN.rsplit("/", 1)[0] + "/" + name


def recreate(name: str) -> None:
    with psycopg.connect(ADMIN, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def drop(name: str) -> None:
    with psycopg.connect(ADMIN, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


async def prepare(name: str, *, rows: int, parts: int | None) -> None:
    """The schema; ``parts`` hourly partitions ending now holding ``rows`` processed rows
    spread evenly over them (or an ordinary table); a few pending rows due now."""
    recreate(name)
    async with await psycopg.AsyncConnection.connect(url_of(name), autocommit=True) as conn:
        await migrate(conn)
        cur = await conn.execute("SELECT date_trunc('hour', now())")
        row = await cur.fetchone()
        assert row is not None
        now: dt.datetime = row[0]
        start = now - dt.timedelta(hours=parts or 0)
        if parts:
            await partitions.convert(conn, interval_ms=HOUR, first_partition_at=start)
            for i in range(parts + 2):
                await partitions.create_partition(conn, start + dt.timedelta(hours=i), HOUR)
        span_s = max(parts or 100, 1) * 3600
        if rows:
            await conn.execute(
                "INSERT INTO webhook_outbox (stream_id, event_type, payload, partition_at,"
                " created_at, processed, processed_at, outcome, endpoint_id)"
                " SELECT 's' || g, 'stream.updated', '{\"k\": 1}',"
                "        %s::timestamptz + (g %% %s) * interval '1 second',"
                "        %s::timestamptz + (g %% %s) * interval '1 second', true,"
                "        %s::timestamptz + (g %% %s) * interval '1 second', 'delivered', 'default'"
                " FROM generate_series(1, %s) g",
                (start, span_s, start, span_s, start, span_s, rows),
            )
        await conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload)"
            " SELECT 'p' || g, 'stream.updated', '{}' FROM generate_series(1, 500) g"
        )
        await conn.execute("VACUUM ANALYZE webhook_outbox")


async def time_claims(name: str, claims: int) -> list[float]:
    """The claim as a dispatcher runs it (on a partitioned outbox: from where pending rows
    start, as the dispatcher reads it every few seconds)."""
    out = []
    async with await psycopg.AsyncConnection.connect(url_of(name)) as conn:
        await conn.set_autocommit(True)
        since = await partitions.pending_since(conn)
        await conn.set_autocommit(False)
        for _ in range(claims):
            started = time.perf_counter()
            async with conn.transaction(force_rollback=True):
                got = await claim_due(conn, 10, since=since)
            out.append((time.perf_counter() - started) * 1000)
            assert len(got) == 10
    return out


def summary(ms: list[float]) -> dict[str, float]:
    ordered = sorted(ms)
    return {
        "p50_ms": round(statistics.median(ordered), 3),
        "p99_ms": round(ordered[int(len(ordered) * 0.99) - 1], 3),
    }


async def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--partitions", type=int, default=100)
    parser.add_argument("--claims", type=int, default=2000)
    opts = parser.parse_args(argv)
    cases = {
        "empty outbox": ("fluxora_bench_claim_empty", 0, None),
        f"ordinary, {opts.rows:,} processed": ("fluxora_bench_claim_plain", opts.rows, None),
        f"{opts.partitions} partitions, {opts.rows:,} processed": (
            "fluxora_bench_claim_parts",
            opts.rows,
            opts.partitions,
        ),
    }
    results: dict[str, Any] = {}
    try:
        for label, (name, rows, parts) in cases.items():
            began = time.monotonic()
            await prepare(name, rows=rows, parts=parts)
            print(f"prepared {label} in {time.monotonic() - began:.0f}s", file=sys.stderr)
            await time_claims(name, 100)  # warm the caches
            results[label] = summary(await time_claims(name, opts.claims))
    finally:
        for name, _, _ in cases.values():
            drop(name)
    base = results["empty outbox"]["p50_ms"]
    print(f"{'claim of 10 rows':<44} {'p50 ms':>8} {'p99 ms':>8} {'x empty':>8}")
    for label, figures in results.items():
        ratio = figures["p50_ms"] / base if base else 0.0
        figures["x_empty_p50"] = round(ratio, 2)
        print(f"{label:<44} {figures['p50_ms']:>8.3f} {figures['p99_ms']:>8.3f} {ratio:>8.2f}")
    RESULTS.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = RESULTS / f"partitions-{stamp}.json"
    path.write_text(json.dumps({"claims": opts.claims, "results": results}, indent=2))
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
