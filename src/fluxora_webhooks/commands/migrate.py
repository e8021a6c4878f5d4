"""``fluxora-webhooks migrate``: apply the pending schema migrations (idempotent, safe to run
from many places at once: they serialize on an advisory lock)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from .common import engines, run_async

NAME = "migrate"
HELP = "apply pending schema migrations (idempotent)"


def configure(parser: argparse.ArgumentParser) -> None:
    return None


def run(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    import psycopg

    from ..migrations import latest_version, migrate

    database_url, _ = engines(env, redis=False)

    async def main() -> int:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            applied = await migrate(conn)
        if applied:
            for m in applied:
                print(f"applied {m.version:04d}_{m.name}")
        else:
            print(f"schema is up to date (version {latest_version()})")
        return 0

    return run_async(main())
