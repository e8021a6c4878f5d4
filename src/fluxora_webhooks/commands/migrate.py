"""``fluxora-webhooks migrate``: apply the pending schema migrations (idempotent, safe to run
from many places at once: they serialize on an advisory lock). ``--partitioned`` makes the
outbox partitioned by time (SPEC 16; see :mod:`fluxora_webhooks.partitions`), converting an
existing one in place. ``--json``: what was done as one object, for scripts."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping

from .common import engines, run_async

DEFAULT_INTERVAL = "1d"

NAME = "migrate"
HELP = "apply pending schema migrations (idempotent)"
DESCRIPTION = (
    "Apply the pending schema migrations. With --partitioned, the outbox becomes native "
    "range partitions by write time (one per --partition-interval), so that retention drops "
    "whole partitions instead of deleting rows; an existing outbox is converted in place, "
    "every row kept (see docs/scaling.md)."
)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--partitioned",
        action="store_true",
        help="partition the outbox by time (also converts an existing one)",
    )
    parser.add_argument(
        "--partition-interval",
        default=None,
        metavar="PERIOD",
        help="the time range of one partition, from 1h to 31d (default 1d)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print what was done as one JSON object (for scripts)",
    )


def run(args: argparse.Namespace, env: Mapping[str, str]) -> int:

    from .. import partitions
    from ..errors import ConfigError
    from ..migrations import (
        MIGRATION_LOCK_KEY,
        applied_versions,
        check_session_pooling,
        installed_elsewhere,
        latest_version,
        migrate,
        take_lock,
    )
    from ..pgtypes import open_session
    from ..settings import format_ms, parse_duration_ms

    if args.partition_interval is not None and not args.partitioned:
        raise ConfigError("--partition-interval", "applies only with --partitioned")
    asked = args.partition_interval
    interval_ms = parse_duration_ms(asked or DEFAULT_INTERVAL, "--partition-interval")
    if not partitions.MIN_INTERVAL_MS <= interval_ms <= 31 * 86_400_000:
        raise ConfigError("--partition-interval", "must be from 1h to 31d")
    database_url, _ = engines(env, redis=False)

    async def main() -> int:
        async with await open_session(database_url, autocommit=True) as conn:
            # A role's or a database's statement timeout, set for an application's queries,
            # would cancel an index build or a conversion's copy part-way (the locks'
            # waits are bounded by the migrations themselves).
            # Its locks are session locks: through a pooler in transaction mode two
            # migrates both took "the" lock, and a failed one left it held by the pool.
            # Checked first: nothing of this session's may reach such a pool's others.
            await check_session_pooling(conn, database_url)
            await conn.execute("SET statement_timeout = 0")
            if not await applied_versions(conn) and (other := await installed_elsewhere(conn)):
                print(f"note: a second installation is made here: {other}", file=sys.stderr)
            applied = await migrate(conn)
            converted = False
            current: int | None = None
            if args.partitioned:
                # Waited for by polling, as migrate() does: another migrate blocked in
                # pg_advisory_lock holds a snapshot the conversion's concurrent index
                # builds would wait for.
                await take_lock(conn)
                try:
                    converted = await partitions.convert(conn, interval_ms=interval_ms)
                    current = (await partitions.layout(conn)).interval_ms
                finally:
                    await conn.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK_KEY,))
        if args.json:
            kept = current is not None and asked is not None and current != interval_ms
            print(
                json.dumps(
                    {
                        "applied": [{"version": m.version, "name": m.name} for m in applied],
                        "version": latest_version(),
                        "partitioned": True if args.partitioned else None,
                        "converted": converted,
                        "partition_interval": None if current is None else format_ms(current),
                        "partition_interval_kept": kept,
                    }
                )
            )
            return 0
        if applied:
            for m in applied:
                print(f"applied {m.version:04d}_{m.name}")
        else:
            print(f"schema is up to date (version {latest_version()})")
        if args.partitioned:
            print("the outbox is partitioned" + (" (converted now)" if converted else ""))
            if current is not None and asked is not None and current != interval_ms:
                # Kept: the existing partitions' ranges cannot change in place.
                print(
                    f"note: its partitions stay {format_ms(current)} each (a partitioned "
                    f"outbox keeps its interval): --partition-interval {asked} is not applied"
                )
            elif current is not None and not converted:
                print(f"its partitions are {format_ms(current)} each")
        return 0

    return run_async(main())
