"""What both benchmarks (``run.py``, ``many.py``) do around their measurements: their own
databases and Redis keys (created, migrated, dropped at the end) and the receiver's counts.

A subclass sets ``admin_url``, ``redis_url``, ``prefix`` (its Redis keys' prefix),
``databases`` (the names it created), ``children`` and ``receiver_url``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from benchlib import ahttp_json
from procs import Child, Children, CpuMeter, process_tree
from psycopg import sql

RESULTS = Path(__file__).resolve().parent / "results"


def add_common_arguments(parser: argparse.ArgumentParser, sections: tuple[str, ...]) -> None:
    """The options both benchmarks take: the preset (``--quick``, ``--tiny``), ``--only``,
    ``--set`` (the dispatchers' environment), the engines and where results go."""
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="smaller run")
    mode.add_argument("--tiny", action="store_true", help="seconds; for the smoke test")
    parser.add_argument("--only", help=f"comma-separated sections ({','.join(sections)})")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="environment for our dispatcher processes, e.g. WEBHOOK_CLAIM_LOOPS=8",
    )
    parser.add_argument("--database-url", default=os.environ.get("BENCH_DATABASE_URL"))
    parser.add_argument("--redis-url", default=os.environ.get("BENCH_REDIS_URL"))
    parser.add_argument("--results", type=Path, default=RESULTS)


def with_dbname(url: str, name: str) -> str:
    """``url`` (a URL or a libpq string) naming the database ``name`` instead."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.scheme.startswith("postgres"):
        return urlunsplit(parts._replace(path="/" + name))
    kept = [p for p in url.split() if not p.startswith("dbname=")]
    return " ".join([*kept, f"dbname={name}"])


class Plumbing:
    admin_url: str
    redis_url: str
    prefix: str
    databases: list[str]
    children: Children
    receiver: Child | None
    receiver_url: str
    log: Callable[[str], None]

    async def migrate(self, database_url: str) -> None:
        """``fluxora-webhooks migrate`` as a command: the code on disk is what the
        dispatcher processes will run, and it may be newer than this process's imports."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLUXORA_")}
        env["DATABASE_URL"] = database_url
        child = await self.children.spawn(
            "migrate", [sys.executable, "-m", "fluxora_webhooks", "migrate"], env
        )
        if await asyncio.wait_for(child.proc.wait(), 120) != 0:
            raise RuntimeError(f"fluxora-webhooks migrate failed:\n{child.log()[-3000:]}")

    async def drop_databases(self) -> None:
        async with await psycopg.AsyncConnection.connect(self.admin_url, autocommit=True) as c:
            for name in self.databases:
                await c.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
                )

    async def drop_redis_keys(self) -> None:
        from redis.asyncio import Redis

        client = Redis.from_url(self.redis_url)
        try:
            keys = [k async for k in client.scan_iter(match=f"*{self.prefix}*", count=1000)]
            if keys:
                await client.delete(*keys)
        finally:
            await client.aclose()

    async def cleanup(self) -> None:
        """Drop this run's databases and Redis keys, whatever state the run ended in."""
        with contextlib.suppress(Exception):
            await self.drop_databases()
        with contextlib.suppress(Exception):
            await self.drop_redis_keys()

    async def stats(self) -> dict[str, Any]:
        result: dict[str, Any] = await ahttp_json(self.receiver_url + "/_stats")
        return result

    async def reset(self) -> None:
        await ahttp_json(self.receiver_url + "/_reset", "POST")

    async def wait_count(self, n: int, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            stats = await self.stats()
            if stats["count"] >= n:
                return stats
            if time.monotonic() > deadline:
                raise RuntimeError(f"receiver got {stats['count']} of {n} in {timeout:.0f}s")
            await asyncio.sleep(0.05)

    @staticmethod
    def rate(stats: dict[str, Any]) -> float:
        span = stats["last"] - stats["first"]
        return (stats["count"] - 1) / span if span > 0 else float("nan")

    @staticmethod
    def rate_since(stats: dict[str, Any], committed: float) -> float:
        """Receipts per second from the producer's commit (unix seconds, the receiver's
        clock is the same machine's) to the last receipt: the whole job, routing included.
        :meth:`rate` (first to last receipt) leaves out whatever ran before the first
        receipt: where events are routed in a transaction of their own, all of a burst's
        routing, as its deliveries come due only after every event."""
        span = stats["last"] - committed
        return stats["count"] / span if span > 0 else float("nan")

    async def raw_run(self, conc: int, processes: int, requests: int) -> dict[str, Any]:
        """The raw HTTP limit: ``processes`` aiohttp client processes (``rawhttp.py``), each
        of ``conc`` keep-alive connections, sharing ``requests`` POSTs to the receiver."""
        await self.reset()
        assert self.receiver is not None
        meter = CpuMeter({"receiver": [self.receiver.pid]})
        meter.start()
        clients = [
            await self.children.script(
                f"raw-{processes}x-c{conc}-{i}",
                "rawhttp.py",
                "--url",
                self.receiver_url + "/raw",
                "--requests",
                str(requests // processes),
                "--concurrency",
                str(conc),
            )
            for i in range(processes)
        ]
        for client in clients:
            await asyncio.wait_for(client.proc.wait(), 300)
        cpu = meter.stop()
        sides = [json.loads(c.log().strip().splitlines()[-1]) for c in clients]
        client_cpu_s = sum(side["cpu_s"] for side in sides)
        cpu["client"] = round(100 * client_cpu_s / max(side["seconds"] for side in sides), 1)
        stats = await self.stats()
        rate = self.rate(stats)
        self.log(f"raw {processes}x c={conc}: {rate:,.0f} req/s")
        return {
            "concurrency": conc,
            "processes": processes,
            "rate": rate,
            "client_rate": sum(side["rate"] for side in sides),
            "errors": sum(side["errors"] for side in sides),
            "connections": stats["connections"],
            "cpu_pct": cpu,
            "client_cpu_us_per_request": round(1e6 * client_cpu_s / stats["count"], 1)
            if stats["count"]
            else None,
        }

    async def wait_workers(self, procs: list[Child], workers: int, timeout: float = 30) -> None:
        """Until each supervisor has its worker processes (they start after it answers)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(len(process_tree(p.pid)) > workers for p in procs):
                return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"workers did not start: {[process_tree(p.pid) for p in procs]}")
