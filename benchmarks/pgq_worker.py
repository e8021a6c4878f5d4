"""The peer: a pgqueuer consumer doing our job (dequeue, POST the payload with aiohttp,
complete), in its own process on uvloop, as its own benchmark tool runs it.

It prints ``READY`` once connected and its entrypoint is registered, then dequeues until
SIGTERM. The jobs live in pgqueuer's own tables (``pgq install``), in their own database.

    python benchmarks/pgq_worker.py --dsn postgresql://... --url http://127.0.0.1:8080/pgq
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import raw_headers, run


async def make_driver(dsn: str, driver: str) -> Any:
    if driver == "asyncpg":
        import asyncpg
        from pgqueuer.db import AsyncpgDriver

        return AsyncpgDriver(await asyncpg.connect(dsn=dsn))
    import psycopg
    from pgqueuer.db import PsycopgDriver

    return PsycopgDriver(await psycopg.AsyncConnection.connect(dsn, autocommit=True))


async def consume(
    dsn: str, url: str, batch: int, driver: str, connections: int, max_tasks: int
) -> None:
    from pgqueuer import PgQueuer
    from pgqueuer.models import Job

    headers = raw_headers(b"")
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections))
    pgq = PgQueuer(await make_driver(dsn, driver))

    @pgq.entrypoint("webhook")
    async def deliver(job: Job) -> None:
        async with session.post(url, data=job.payload, headers=headers) as response:
            await response.read()
            if response.status >= 300:
                raise RuntimeError(f"HTTP {response.status}")

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, pgq.shutdown.set)
    print("READY", flush=True)
    try:
        await pgq.run(batch_size=batch, max_concurrent_tasks=max_tasks or None)
    finally:
        await session.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--url", required=True)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--driver", choices=("asyncpg", "psycopg"), default="asyncpg")
    parser.add_argument("--connections", type=int, default=100)
    parser.add_argument("--max-tasks", type=int, default=0, help="0: unbounded")
    args = parser.parse_args()
    run(consume(args.dsn, args.url, args.batch, args.driver, args.connections, args.max_tasks))


if __name__ == "__main__":
    main()
