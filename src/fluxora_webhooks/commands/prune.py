"""``fluxora-webhooks prune``: delete the delivery history older than a period.

Processed outbox rows (delivered, retried or dead-lettered attempts) whose
``processed_at`` is older than ``--older-than`` are deleted in bounded batches; pending
rows never are. With ``--dead-letters``, dead letters already replayed or purged before
then go too (dead letters still waiting stay). See :mod:`fluxora_webhooks.retention`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from ..errors import ConfigError
from ..retention import DEFAULT_BATCH_SIZE, MAX_BATCH_SIZE, PruneResult
from .common import check_database, connect, engines, int_option, run_async

if TYPE_CHECKING:
    from ..partitions import Dropped

NAME = "prune"
HELP = "delete processed rows older than a retention period"
DESCRIPTION = (
    "Delete processed outbox rows (the attempt history) older than a period, in "
    "short batches, alongside running dispatchers. Pending rows are never touched."
)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--older-than",
        required=True,
        metavar="PERIOD",
        help="age of the history to delete, e.g. 7d, 12h, 90m (units ms, s, m, h, d; at most"
        " 36500d)",
    )
    parser.add_argument(
        "--dead-letters",
        action="store_true",
        help="also delete dead letters replayed or purged before then (never waiting ones)",
    )
    parser.add_argument(
        "--batch-size",
        type=int_option("--batch-size", low=1, high=MAX_BATCH_SIZE),
        default=DEFAULT_BATCH_SIZE,
        metavar="N",
        help=f"rows per transaction (default {DEFAULT_BATCH_SIZE}, at most {MAX_BATCH_SIZE})",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="count what would be deleted; delete nothing"
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace, env: Mapping[str, str]) -> int:

    from ..partitions import drop_expired_exclusive, whole_partitions
    from ..retention import exclusive_run, prune
    from ..settings import parse_duration_ms

    opts = args
    older_than_ms = parse_duration_ms(opts.older_than, "--older-than")
    if older_than_ms == 0:
        # As WEBHOOK_RETENTION=0d is off, a zero period here is a slip, not "everything".
        raise ConfigError(
            "--older-than", "must be more than 0 (0 would delete the whole history at once)"
        )
    database_url, _ = engines(env, redis=False)

    async def main() -> int:
        # Its lock is a session lock (see check_session_pooling).
        await check_database(database_url, session=True, connect_timeout=10)
        # The service's retention lock for the whole run (see exclusive_run). A partitioned
        # outbox: its expired partitions are dropped whole first, and rows are deleted only
        # outside the partitions that will be dropped whole.
        async with (
            connect(database_url, connect_timeout=10) as conn,
            exclusive_run(conn, wait=True, on_wait=_say_waiting),
        ):
            # Waited for as the retention lock is: a dispatcher making partitions holds it
            # a moment; skipped, the expired partitions' rows would be deleted one by one.
            done = await drop_expired_exclusive(
                conn,
                older_than_ms=older_than_ms,
                dry_run=opts.dry_run,
                wait=True,
                on_wait=_say_waiting_for_partitions,
            )
            dropped, kept = done if done else ([], [])
            result = await prune(
                conn,
                older_than_ms=older_than_ms,
                dead_letters=opts.dead_letters,
                batch_size=opts.batch_size,
                dry_run=opts.dry_run,
                spare=await whole_partitions(conn, older_than_ms=older_than_ms),
            )
        if opts.dry_run and dropped:
            # Counted as rows by the dry run's count; they would go with their partitions.
            rows = result.outbox_rows - sum(d.rows for d in dropped)
            result = dataclasses.replace(result, outbox_rows=max(rows, 0))
        report(result, opts, dropped, kept)
        return 0

    return run_async(main())


def _say_waiting() -> None:
    # The lock does not say whose it is: any of them may hold it.
    print(
        "waiting for another retention run on this database to end (a prune command, or a"
        " dispatcher with WEBHOOK_RETENTION)",
        file=sys.stderr,
    )


def _say_waiting_for_partitions() -> None:
    print(
        "waiting for another process to finish with the outbox's partitions (a dispatcher"
        " making or dropping them)",
        file=sys.stderr,
    )


def report(
    result: PruneResult,
    opts: argparse.Namespace,
    dropped: Sequence[Dropped] = (),
    kept: Sequence[str] = (),
) -> None:
    if opts.json:
        shown = result.as_dict()
        shown["partitions_dropped"] = [{"name": d.name, "rows": d.rows} for d in dropped]
        shown["partitions_kept"] = list(kept)
        print(json.dumps(shown))
        return
    verb = "would delete" if result.dry_run else "deleted"
    cutoff = result.cutoff.isoformat(timespec="seconds") if result.cutoff else "?"
    dropping = "would drop" if result.dry_run else "dropped"
    for one in dropped:
        print(f"{dropping} outbox partition {one.name} ({one.rows} processed row(s))")
    for name in kept:
        print(
            f"kept outbox partition {name}: it still holds a row not processed before the"
            " cutoff (its older processed rows are deleted one by one)"
        )
    print(f"{verb} {result.outbox_rows} processed outbox row(s) older than {cutoff}")
    if opts.dead_letters:
        print(f"{verb} {result.dead_letters} replayed or purged dead letter(s)")
    if not result.dry_run:
        print(f"{result.batches} batch(es) of at most {opts.batch_size} rows")
