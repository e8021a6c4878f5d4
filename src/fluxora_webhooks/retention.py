"""Retention: delete the attempt history (processed outbox rows) and settled dead letters
once they are older than a period.

Used by ``fluxora-webhooks prune`` and, when ``WEBHOOK_RETENTION`` is set, by ``run`` on an
interval. The work is done in bounded batches, each its own short transaction (the
connection is in autocommit mode)::

    DELETE FROM webhook_outbox WHERE id IN (
        SELECT id FROM webhook_outbox
        WHERE processed AND processed_at < $cutoff
        ORDER BY processed_at LIMIT $batch FOR UPDATE SKIP LOCKED)

so a prune never holds many locks or a long transaction, never waits on a row someone
else holds, and runs side by side with dispatchers, producers and other prunes.

What is never deleted: unprocessed rows (pending, due or not), and dead letters still
waiting (state ``dead``). With ``dead_letters``, dead letters in state ``replayed`` or
``purged`` whose state changed before the cutoff are deleted too.

The cutoff is computed once per run from the database's clock, so a run ends even while
new rows keep ageing past the period.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg

from .queries import query, session_lock

DEFAULT_BATCH_SIZE = 5000
MAX_BATCH_SIZE = 100_000
# A hundred years (settings.MAX_DURATION_MS, the bound of every duration setting): a
# longer period makes PostgreSQL's cutoff timestamp overflow.
MAX_OLDER_THAN_MS = 36_500 * 86_400_000
# Fixed, like the migration lock: "fluxora-webhooks retention".
RETENTION_LOCK_KEY = 0x666C7578726574
# A prune must not queue for long behind a lock someone else holds on the table.
LOCK_TIMEOUT = "5s"


@dataclass(frozen=True, slots=True)
class PruneResult:
    """What one run deleted (or, for a dry run, would delete)."""

    cutoff: dt.datetime | None
    outbox_rows: int = 0
    dead_letters: int = 0
    batches: int = 0
    dry_run: bool = False
    skipped: bool = False  # exclusive run: another instance holds the retention lock

    def as_dict(self) -> dict[str, Any]:
        return {
            "cutoff": self.cutoff.isoformat() if self.cutoff else None,
            "outbox_rows": self.outbox_rows,
            "dead_letters": self.dead_letters,
            "batches": self.batches,
            "dry_run": self.dry_run,
            "skipped": self.skipped,
        }


def exclusive_run(
    conn: psycopg.AsyncConnection[Any],
    *,
    wait: bool = False,
    on_wait: Callable[[], None] | None = None,
) -> contextlib.AbstractAsyncContextManager[bool]:
    """The retention lock for a whole run (partition drops and row pruning together, so
    that no instance deletes the rows of a partition another is detaching): see
    :func:`fluxora_webhooks.queries.session_lock`."""
    return session_lock(conn, RETENTION_LOCK_KEY, wait=wait, on_wait=on_wait)


async def prune(
    conn: psycopg.AsyncConnection[Any],
    *,
    older_than_ms: int,
    dead_letters: bool = False,
    batch_size: int = DEFAULT_BATCH_SIZE,
    pause_s: float = 0.0,
    exclusive: bool = False,
    dry_run: bool = False,
    on_batch: Callable[[str, int], None] | None = None,
    spare: tuple[dt.datetime, dt.datetime] | None = None,
) -> PruneResult:
    """Delete processed outbox rows whose ``processed_at`` is older than ``older_than_ms``
    (and, with ``dead_letters``, settled dead letters), ``batch_size`` rows per transaction.

    ``conn`` must be in autocommit mode. ``pause_s`` sleeps between batches (to spread the
    load). ``exclusive`` first takes a session advisory lock and returns ``skipped`` when
    another pruner holds it (the service uses it so that instances take turns).
    ``dry_run`` only counts. ``on_batch(table, rows)`` is called after each batch.
    ``spare``: on a partitioned outbox, the range of ``partition_at`` whose partitions
    are dropped whole once they expire (see
    :func:`fluxora_webhooks.partitions.whole_partitions`): their rows are left to that.
    """
    if not 0 <= older_than_ms <= MAX_OLDER_THAN_MS:
        raise ValueError("older_than_ms must be from 0 to 100 years")
    if not 1 <= batch_size <= MAX_BATCH_SIZE:
        raise ValueError(f"batch_size must be between 1 and {MAX_BATCH_SIZE}")
    if not conn.autocommit:
        raise ValueError("prune needs a connection in autocommit mode (one transaction a batch)")
    async with contextlib.AsyncExitStack() as stack:
        if exclusive and not await stack.enter_async_context(exclusive_run(conn)):
            return PruneResult(cutoff=None, skipped=True, dry_run=dry_run)
        try:
            await conn.execute(f"SET lock_timeout = '{LOCK_TIMEOUT}'")
            cur = await conn.execute(query("retention_cutoff"), {"older_than_ms": older_than_ms})
            row = await cur.fetchone()
            assert row is not None
            cutoff: dt.datetime = row[0]
            outbox_query = "prune_outbox" if spare is None else "prune_outbox_sparing"
            params: dict[str, Any] = {"cutoff": cutoff}
            if spare is not None:
                params["spare_from"], params["spare_until"] = spare
            if dry_run:
                outbox = await _scalar(conn, outbox_query + "_count", params)
                dead = (
                    await _scalar(conn, "prune_dead_letters_count", {"cutoff": cutoff})
                    if dead_letters
                    else 0
                )
                return PruneResult(cutoff, outbox, dead, 0, dry_run=True)
            outbox, batches = await _drain(
                conn, outbox_query, "outbox", params, batch_size, pause_s, on_batch
            )
            dead = 0
            if dead_letters:
                dead, more = await _drain(
                    conn,
                    "prune_dead_letters",
                    "dead_letter",
                    {"cutoff": cutoff},
                    batch_size,
                    pause_s,
                    on_batch,
                )
                batches += more
            return PruneResult(cutoff, outbox, dead, batches)
        finally:
            # Best effort: a broken connection releases its session settings anyway.
            with contextlib.suppress(psycopg.Error):
                if not conn.closed:
                    await conn.execute("RESET lock_timeout")


async def _drain(
    conn: psycopg.AsyncConnection[Any],
    name: str,
    table: str,
    params: dict[str, Any],
    batch_size: int,
    pause_s: float,
    on_batch: Callable[[str, int], None] | None,
) -> tuple[int, int]:
    """Run one batch query until a batch comes back short. Returns (rows, batches)."""
    total = batches = 0
    sql = query(name)
    while True:
        cur = await conn.execute(sql, {**params, "batch": batch_size})
        row = await cur.fetchone()
        deleted = int(row[0]) if row else 0
        batches += 1
        total += deleted
        if on_batch is not None and deleted:
            on_batch(table, deleted)
        if deleted < batch_size:
            # Short: nothing older is left, or only rows other transactions hold (SKIP
            # LOCKED); those go in the next run.
            return total, batches
        if pause_s > 0:
            await asyncio.sleep(pause_s)


async def _scalar(conn: psycopg.AsyncConnection[Any], name: str, params: dict[str, Any]) -> int:
    cur = await conn.execute(query(name), params)
    row = await cur.fetchone()
    return int(row[0]) if row else 0
