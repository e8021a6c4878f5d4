"""What the wake-up NOTIFY costs producers: commits per second with and without it.

    .venv/bin/python benchmarks/notify_commits.py [--connections 16] [--seconds 4]

A PostgreSQL primary of its own (durable: fsync and synchronous_commit on), first alone,
then with a synchronous standby. ``--connections`` producers each commit one event per
transaction, as applications do, for ``--seconds``, with the outbox's NOTIFY trigger
enabled, then with the wake-up switched off for the database (``fluxora.notify = off``,
what a user does), then with the trigger disabled (``ALTER TABLE ... DISABLE TRIGGER``, the
floor). A transaction that notifies holds one cluster-wide lock from before its commit
record until after it (PostgreSQL serialises the notification queue in commit order), so
such commits cannot share a WAL flush or a wait for the standby: the two rows per setup
show what that costs. See docs/scaling.md.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
from tests.support.replication import ReplicatedPostgres, make_synchronous  # noqa: E402

from fluxora_webhooks.migrations import migrate  # noqa: E402

TRIGGER = "webhook_outbox_notify_trg"


class DurablePostgres(ReplicatedPostgres):
    """fsync on: the commits' flushes are the point here."""

    def start(self) -> None:
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.folder} "
            "-c max_connections=100 -c synchronous_commit=on"
        )
        self._run("pg_ctl", "start", "-D", str(self.data), "-l", str(self.log_path), "-w",
                  "-t", "60", "-o", options)  # fmt: skip


async def commits_per_s(url: str, connections: int, seconds: float) -> float:
    stop = time.monotonic() + seconds
    count = 0

    async def producer() -> None:
        nonlocal count
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            while time.monotonic() < stop:
                await conn.execute(
                    "INSERT INTO webhook_outbox (stream_id, event_type, payload)"
                    " VALUES ('s', 'stream.updated', '{}')"
                )
                count += 1

    await asyncio.gather(*(producer() for _ in range(connections)))
    return count / seconds


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()
    primary, standby = DurablePostgres(), DurablePostgres()
    rows: list[tuple[str, float, float, float]] = []
    try:
        primary.init()
        primary.start()
        with psycopg.connect(primary.url(), autocommit=True) as conn:
            conn.execute("CREATE DATABASE notify_bench")
        url = primary.url("notify_bench")
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            await migrate(conn)

        async def measure(setup: str) -> None:
            rates = []
            for trigger, notify in (("ENABLE", "on"), ("ENABLE", "off"), ("DISABLE", "on")):
                async with await psycopg.AsyncConnection.connect(url, autocommit=True) as c:
                    await c.execute(f"ALTER TABLE webhook_outbox {trigger} TRIGGER {TRIGGER}")
                    await c.execute(f"ALTER DATABASE notify_bench SET fluxora.notify = {notify}")
                rates.append(await commits_per_s(url, args.connections, args.seconds))
            rows.append((setup, *rates))

        await measure("primary alone")
        standby.clone_from(primary)
        standby.start()
        make_synchronous(primary)
        await measure("primary + synchronous standby")
    finally:
        primary.cleanup()
        standby.cleanup()
    print(
        f"| setup ({args.connections} producers) | commits/s with the NOTIFY"
        " | fluxora.notify = off | the trigger disabled | off / with |"
    )
    print("|---|---:|---:|---:|---:|")
    for setup, with_notify, switched_off, without in rows:
        print(
            f"| {setup} | {with_notify:,.0f} | {switched_off:,.0f} | {without:,.0f}"
            f" | x{switched_off / with_notify:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
