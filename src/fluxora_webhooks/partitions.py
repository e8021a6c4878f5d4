"""The partitioned outbox (SPEC 16): ``webhook_outbox`` as native range partitions on
``partition_at`` (when a row was written), chosen at installation with ``fluxora-webhooks
migrate --partitioned``, which also converts an existing outbox in place.

- The conversion (:func:`convert`) keeps every row: the existing table becomes the first
  partition (``webhook_outbox_legacy``, everything written before the conversion), attached
  without a scan thanks to a validated CHECK constraint; new partitions of one interval each
  follow, and a default partition catches a row no partition covers (it should stay empty:
  the service creates partitions ahead, so a producer's insert never fails for want of one).
- The service keeps partitions ready ahead (:func:`ensure_ahead`) and, with
  ``WEBHOOK_RETENTION``, drops whole partitions instead of deleting rows
  (:func:`drop_expired`): a partition goes only when its range ended before the retention
  cutoff, none of its rows is unprocessed (pending, parked, waiting) and every row was
  processed before the cutoff, checked while the partition is detached, in the transaction
  that drops it.
- The claim is the same query; each partition has its own partial due index, and a
  partition whose rows are all processed has an empty one.
- Privileges: neither ``CREATE TABLE (LIKE ...)`` nor a new partition copies any, and a
  table is its creator's. The new parent takes the old table's owner and privileges (every
  grantee's, its columns' too, grant options included) in the transaction of the swap;
  every partition takes the parent's when it is created, and the maintenance
  (:func:`ensure_ahead`, run by the owner) gives a later GRANT or REVOKE on the parent to
  every partition. Creating, attaching, detaching and dropping partitions need the owner
  of ``webhook_outbox`` (or a member of its role): see :data:`OWNER_HINT`.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from .errors import FluxoraError
from .pgtypes import as_utc, described
from .queries import query, session_lock

log = logging.getLogger(__name__)

PARENT = "webhook_outbox"
LEGACY = "webhook_outbox_legacy"
DEFAULT = "webhook_outbox_default"
_BOUND = "webhook_outbox_legacy_bound"  # CHECK (partition_at < cut) while converting
CONFIG = "fluxora_outbox_partitioning"
DEFAULT_INTERVAL_MS = 86_400_000
MIN_INTERVAL_MS = 3_600_000
PARTITIONS_AHEAD = 3
# Fixed, like the migration lock: "fluxora-webhooks partitions".
PARTITION_LOCK_KEY = 0x666C7570617274
# Detaching takes the parent's strongest lock for a moment: never queue behind a batch for
# long (the next maintenance run tries again).
DETACH_LOCK_TIMEOUT = "2s"
# What to do when a role may not create or drop partitions (PostgreSQL lets only a table's
# owner, or a member of its role, create, attach, detach or drop its partitions).
OWNER_HINT = (
    "outbox partitions are created and dropped only by the owner of webhook_outbox or a"
    " member of its role: run this as that role, or create the partitions ahead as the owner"
    ' with `fluxora-webhooks migrate --partitioned` (docs/operations.md, "Partitions and'
    ' roles")'
)
DROP_HINT = (
    "outbox partitions are detached and dropped only by the owner of webhook_outbox or a"
    " member of its role: run prune, or the dispatchers' WEBHOOK_RETENTION, as that role"
    " (meanwhile a dispatcher's retention deletes their processed rows one by one;"
    ' docs/operations.md, "Partitions and roles")'
)
READ_HINT = (
    "a role needs its privileges on webhook_outbox on each partition too, and SELECT on"
    " fluxora_outbox_partitioning: the owner's partition maintenance gives them (a"
    " dispatcher running as the owner, or `fluxora-webhooks migrate --partitioned` run as"
    ' the owner; docs/operations.md, "Partitions and roles")'
)
# The dispatcher's warning that it cannot read a partition, at most this often.
UNREADABLE_WARNING_S = 600.0

# The outbox's indexes and checks, as the migrations define them, created on the parent.
_INDEXES = (
    ("webhook_outbox_due_idx", "(created_at, id) WHERE NOT processed"),
    ("webhook_outbox_delivery_idx", "(delivery_id)"),
    ("webhook_outbox_processed_at_idx", "(processed_at) WHERE processed"),
    ("webhook_outbox_endpoint_pending_idx", "(endpoint_id, id) WHERE NOT processed"),
    (
        "webhook_outbox_stream_idx",
        "(endpoint_id, stream_id, stream_seq, id) WHERE NOT processed AND stream_seq IS NOT NULL",
    ),
    (
        "webhook_outbox_stream_active_idx",
        "(endpoint_id, stream_id) WHERE NOT processed AND stream_seq IS NOT NULL AND hold IS NULL",
    ),
    (
        "webhook_outbox_heads_due_idx",
        "(created_at, id) WHERE NOT processed AND stream_seq IS NOT NULL AND hold IS NULL",
    ),
    (
        "webhook_outbox_unrouted_idx",
        "(tenant, stream_id, id) WHERE NOT processed AND endpoint_id IS NULL",
    ),
    ("webhook_outbox_event_idx", "(event_id) WHERE event_id IS NOT NULL"),
    (
        "webhook_outbox_tenant_events_idx",
        "(tenant, id) WHERE event_id IS NULL AND tenant <> '' AND tenant <> '!operator'",
    ),
    (
        "webhook_outbox_endpoint_deliveries_idx",
        "(endpoint_id, id) WHERE attempt = 1 AND NOT replay AND endpoint_id IS NOT NULL"
        " AND endpoint_id <> 'default' AND endpoint_id <> 'operator'",
    ),
    (
        "webhook_outbox_tenant_deliveries_idx",
        "(tenant, id) WHERE attempt = 1 AND NOT replay AND endpoint_id IS NOT NULL"
        " AND tenant <> '' AND tenant <> '!operator'",
    ),
    (
        "webhook_outbox_stream_events_idx",
        "(stream_id, tenant, id) WHERE event_id IS NULL AND tenant <> '!operator'"
        " AND octet_length(stream_id) <= 2000",
    ),
    (
        "webhook_outbox_stream_deliveries_idx",
        "(stream_id, tenant, id) WHERE attempt = 1 AND NOT replay AND endpoint_id IS NOT NULL"
        " AND octet_length(stream_id) <= 2000",
    ),
    (
        "webhook_outbox_tenant_type_events_idx",
        "(tenant, event_type, id)"
        " WHERE event_id IS NULL AND tenant <> '' AND tenant <> '!operator'",
    ),
    ("webhook_outbox_id_idx", "(id)"),
)
_AUTOVACUUM = (
    "autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000,"
    " autovacuum_analyze_scale_factor = 0.02"
)


@dataclass(frozen=True)
class Layout:
    """How the outbox is partitioned (None interval: an ordinary table)."""

    interval_ms: int | None

    @property
    def partitioned(self) -> bool:
        return self.interval_ms is not None


async def layout(conn: psycopg.AsyncConnection[Any]) -> Layout:
    cur = await conn.execute(
        "SELECT c.relkind = 'p', (SELECT interval_ms FROM " + CONFIG + " LIMIT 1)"
        " FROM pg_class c WHERE c.oid = to_regclass(%s)"
        if await _exists(conn, CONFIG)
        else "SELECT c.relkind = 'p', NULL::bigint FROM pg_class c WHERE c.oid = to_regclass(%s)",
        (PARENT,),
    )
    row = await cur.fetchone()
    if row is None or not row[0]:
        return Layout(None)
    return Layout(int(row[1] or DEFAULT_INTERVAL_MS))


async def _exists(conn: psycopg.AsyncConnection[Any], name: str) -> bool:
    cur = await conn.execute("SELECT to_regclass(%s) IS NOT NULL", (name,))
    row = await cur.fetchone()
    return bool(row and row[0])


def partition_name(lower: dt.datetime) -> str:
    return f"{PARENT}_p{lower.astimezone(dt.UTC):%Y%m%d_%H%M}"


def _bounds(moment: dt.datetime, interval_ms: int) -> tuple[dt.datetime, dt.datetime]:
    """The interval containing ``moment`` (intervals count from the unix epoch, UTC)."""
    ms = int(moment.timestamp() * 1000)
    start_ms = ms - ms % interval_ms
    start = dt.datetime.fromtimestamp(start_ms / 1000, dt.UTC)
    return start, start + dt.timedelta(milliseconds=interval_ms)


async def _db_now(conn: psycopg.AsyncConnection[Any]) -> dt.datetime:
    cur = await conn.execute("SELECT clock_timestamp()")
    row = await cur.fetchone()
    assert row is not None
    return as_utc(row[0])


async def convert(
    conn: psycopg.AsyncConnection[Any],
    *,
    interval_ms: int = DEFAULT_INTERVAL_MS,
    first_partition_at: dt.datetime | None = None,
) -> bool:
    """Make the outbox partitioned, keeping every row. ``conn`` in autocommit mode, after
    the migrations. Idempotent: returns False when it already is.

    The existing table must first satisfy ``partition_at < cut`` as a validated constraint
    (added NOT VALID, then validated: a scan that does not block writes); then, in one
    short transaction, it is renamed, a partitioned ``webhook_outbox`` takes its place with
    its columns, indexes and trigger, and the old table is attached as its first partition
    (no scan, no rewrite).

    ``first_partition_at``: where the first partition starts (the old table holds what is
    before it). By default an interval boundary more than one interval ahead, so that rows
    written while converting still fit the old table; an earlier one is only for an outbox
    nobody writes to meanwhile (a new installation, a test).

    On an outbox already partitioned, it makes the partitions ahead and gives every
    partition the parent's privileges, as the service's maintenance does (the command an
    owner runs when the dispatchers' role may not create partitions)."""
    if not MIN_INTERVAL_MS <= interval_ms <= 31 * 86_400_000:
        raise ValueError("the partition interval must be from 1h to 31d")
    if (await layout(conn)).partitioned:
        await _ensure_ahead_waiting(conn)
        return False
    if first_partition_at is None and await _convert_empty(conn, interval_ms):
        await _ensure_ahead_waiting(conn)
        return True
    now = await _db_now(conn)
    if first_partition_at is None:
        _, cut = _bounds(now + dt.timedelta(milliseconds=interval_ms), interval_ms)
    else:
        cut = _bounds(first_partition_at, interval_ms)[0]
    bound = sql.Identifier(_BOUND)
    await conn.execute(
        sql.SQL(
            "ALTER TABLE webhook_outbox DROP CONSTRAINT IF EXISTS {b},"
            " ADD CONSTRAINT {b} CHECK (partition_at < {cut}) NOT VALID"
        ).format(b=bound, cut=sql.Literal(cut))
    )
    await conn.execute(sql.SQL("ALTER TABLE webhook_outbox VALIDATE CONSTRAINT {}").format(bound))
    # The parent indexes rows by id (it has no primary key: a partitioned table's key must
    # hold the partition key); the old table needs the same index to be attached without a
    # build under the exclusive lock, so it is built first, without blocking writes.
    await conn.execute(
        "CREATE INDEX CONCURRENTLY IF NOT EXISTS webhook_outbox_id_idx ON webhook_outbox (id)"
    )
    async with conn.transaction():
        await conn.execute("LOCK TABLE webhook_outbox IN ACCESS EXCLUSIVE MODE")
        await _swap(conn, cut, interval_ms)
    await _ensure_ahead_waiting(conn)
    return True


async def _ensure_ahead_waiting(conn: psycopg.AsyncConnection[Any]) -> None:
    """:func:`ensure_ahead` under the partitions' session lock, waited for (a dispatcher's
    maintenance holds it for a moment): two never create the same partition at once."""
    async with session_lock(conn, PARTITION_LOCK_KEY, wait=True):
        await ensure_ahead(conn)


async def _convert_empty(conn: psycopg.AsyncConnection[Any], interval_ms: int) -> bool:
    """An empty outbox (a new installation) converted in one transaction under the lock,
    its first partition the current interval's: nothing before it to keep, so no legacy
    range reaching ahead (rows would sit there until deleted one by one). False, having
    changed nothing, when it holds rows."""
    async with conn.transaction():
        await conn.execute("LOCK TABLE webhook_outbox IN ACCESS EXCLUSIVE MODE")
        cur = await conn.execute("SELECT NOT EXISTS (SELECT 1 FROM webhook_outbox)")
        row = await cur.fetchone()
        if not (row and row[0]):
            return False
        cut = _bounds(await _db_now(conn), interval_ms)[0]
        await conn.execute(
            sql.SQL("ALTER TABLE webhook_outbox ADD CONSTRAINT {} CHECK (partition_at < {})")
            .format(sql.Identifier(_BOUND), sql.Literal(cut))
        )  # fmt: skip
        await conn.execute(
            "CREATE INDEX IF NOT EXISTS webhook_outbox_id_idx ON webhook_outbox (id)"
        )
        await _swap(conn, cut, interval_ms)
    return True


async def _swap(conn: psycopg.AsyncConnection[Any], cut: dt.datetime, interval_ms: int) -> None:
    """In the caller's transaction: the table (proved to hold only rows before ``cut``)
    becomes the legacy partition of a partitioned ``webhook_outbox``. The caller holds the
    table's ACCESS EXCLUSIVE lock."""
    await conn.execute(f"ALTER TABLE {PARENT} RENAME TO {LEGACY}")
    for name, _ in _INDEXES:
        await conn.execute(f"ALTER INDEX IF EXISTS {name} RENAME TO {name}_legacy")
    await conn.execute(f"DROP TRIGGER IF EXISTS webhook_outbox_notify_trg ON {LEGACY}")
    await conn.execute(
        f"CREATE TABLE {PARENT} (LIKE {LEGACY} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)"
        " PARTITION BY RANGE (partition_at)"
    )
    # LIKE copies no privilege, and the new table is the current user's: the old table's
    # owner (before the sequence is given to it: they must have the same) and privileges
    # go with the name. The sequence keeps its own.
    await _take_privileges(conn, LEGACY, [PARENT])
    await conn.execute(sql.SQL("ALTER TABLE {} DROP CONSTRAINT {}").format(
        sql.Identifier(PARENT), sql.Identifier(_BOUND)
    ))  # fmt: skip
    await conn.execute(f"ALTER SEQUENCE webhook_outbox_id_seq OWNED BY {PARENT}.id")
    for name, definition in _INDEXES:
        await conn.execute(f"CREATE INDEX {name} ON {PARENT} {definition}")
    await conn.execute(
        f"ALTER TABLE {PARENT} ATTACH PARTITION {LEGACY}"
        f" FOR VALUES FROM (MINVALUE) TO ({sql.Literal(cut).as_string(conn)})"
    )
    await conn.execute(sql.SQL("ALTER TABLE {} DROP CONSTRAINT {}").format(
        sql.Identifier(LEGACY), sql.Identifier(_BOUND)
    ))  # fmt: skip
    await conn.execute(f"CREATE TABLE {DEFAULT} PARTITION OF {PARENT} DEFAULT")
    await conn.execute(f"ALTER TABLE {DEFAULT} SET ({_AUTOVACUUM})")
    await _take_privileges(conn, PARENT, [DEFAULT])
    await conn.execute(
        "CREATE TRIGGER webhook_outbox_notify_trg AFTER INSERT ON webhook_outbox"
        " REFERENCING NEW TABLE AS inserted"
        " FOR EACH STATEMENT EXECUTE FUNCTION webhook_outbox_notify()"
    )
    await conn.execute(
        f"CREATE TABLE {CONFIG} (interval_ms bigint NOT NULL,"
        " converted_at timestamptz NOT NULL DEFAULT now(), legacy_until timestamptz)"
    )
    await conn.execute(
        f"INSERT INTO {CONFIG} (interval_ms, legacy_until) VALUES (%s, %s)",
        (interval_ms, cut),
    )
    await _align_owner(conn, PARENT, CONFIG)
    await _share_config(conn)


async def ensure_ahead(
    conn: psycopg.AsyncConnection[Any], ahead: int = PARTITIONS_AHEAD
) -> list[str]:
    """Create the partitions from now to ``ahead`` intervals ahead that do not exist yet.
    Returns their names."""
    current = await layout(conn)
    if not current.partitioned:
        return []
    assert current.interval_ms is not None
    interval = dt.timedelta(milliseconds=current.interval_ms)
    now = await _db_now(conn)
    cur = await conn.execute(f"SELECT legacy_until FROM {CONFIG} LIMIT 1")
    row = await cur.fetchone()
    # The legacy partition ends on an interval boundary; partitions follow from there.
    # Bounds in UTC (pgtypes.as_utc): a day added on the session's wall clock is 23 or 25
    # hours across a DST change.
    start = _bounds(now, current.interval_ms)[0]
    if row and row[0] and row[0] > start:
        start = as_utc(row[0])
    created = []
    # Rows of intervals before the current one that sit in the default partition (written
    # while no dispatcher made partitions: all of them down for a few intervals) get their
    # partitions too, moved into them: only intervals that hold such rows.
    for lower in await _past_intervals(conn, start, current.interval_ms):
        name = await create_partition(conn, lower, current.interval_ms)
        if name is not None:
            created.append(name)
    lower = start
    while lower < now + interval * ahead:
        name = await create_partition(conn, lower, current.interval_ms)
        if name is not None:
            created.append(name)
        lower += interval
    if created:
        log.info("outbox partitions created: %s", ", ".join(created))
    if await _acts_as_owner(conn):
        # A GRANT or REVOKE on the parent since a partition was created reaches it now (a
        # non-owner could not: a GRANT it may not make is only a warning).
        cur = await conn.execute(
            "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
            " WHERE i.inhparent = to_regclass(%s)",
            (PARENT,),
        )
        every = [str(row[0]) for row in await cur.fetchall()]
        await _take_privileges(conn, PARENT, every, owner=False)
        await _share_config(conn)
    return created


async def create_partition(
    conn: psycopg.AsyncConnection[Any], lower: dt.datetime, interval_ms: int
) -> str | None:
    """The partition of ``[lower, lower + interval)``, unless it exists. Returns its name
    when created."""
    lower = as_utc(lower)
    name = partition_name(lower)
    if await _exists(conn, name):
        return None
    upper = lower + dt.timedelta(milliseconds=interval_ms)
    in_range = sql.SQL("partition_at >= {} AND partition_at < {}").format(
        sql.Literal(lower), sql.Literal(upper)
    )
    if not await default_rows(conn, 1, in_range):
        async with conn.transaction():  # never seen without the parent's privileges
            await conn.execute(
                sql.SQL(
                    "CREATE TABLE {} PARTITION OF webhook_outbox FOR VALUES FROM ({}) TO ({})"
                    " WITH ({})"
                ).format(
                    sql.Identifier(name),
                    sql.Literal(lower),
                    sql.Literal(upper),
                    sql.SQL(_AUTOVACUUM),
                )
            )
            await _take_privileges(conn, PARENT, [name])
        return name
    # Rows of this range are in the default partition (no dispatcher made partitions ahead
    # for a while, or a producer wrote a far partition_at): a partition cannot be created
    # over them, and every later one would wait behind it. They move into the new table,
    # which is then attached, in one transaction (the default partition locked meanwhile).
    async with conn.transaction():
        await conn.execute(sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(
            sql.Identifier(DEFAULT)
        ))  # fmt: skip
        await conn.execute(
            sql.SQL(
                "CREATE TABLE {} (LIKE webhook_outbox INCLUDING DEFAULTS INCLUDING CONSTRAINTS)"
                " WITH ({})"
            ).format(sql.Identifier(name), sql.SQL(_AUTOVACUUM))
        )
        await _take_privileges(conn, PARENT, [name])
        cur = await conn.execute(
            sql.SQL(
                "WITH moved AS (DELETE FROM {} WHERE {} RETURNING *)"
                " INSERT INTO {} SELECT * FROM moved"
            ).format(sql.Identifier(DEFAULT), in_range, sql.Identifier(name))
        )
        moved = cur.rowcount
        await conn.execute(
            sql.SQL("ALTER TABLE webhook_outbox ATTACH PARTITION {} FOR VALUES FROM ({}) TO ({})")
            .format(sql.Identifier(name), sql.Literal(lower), sql.Literal(upper))
        )  # fmt: skip
    log.warning("moved %d outbox row(s) from %s into the new partition %s", moved, DEFAULT, name)
    return name


_EVERY_ROW = sql.SQL("true")
# At most this many past intervals are given partitions per call (the next call goes on).
MAX_PAST_INTERVALS = 100


async def _past_intervals(
    conn: psycopg.AsyncConnection[Any], before: dt.datetime, interval_ms: int
) -> list[dt.datetime]:
    """The lower bounds of the intervals before ``before`` that rows in the default
    partition belong to, oldest first."""
    if not await _exists(conn, DEFAULT):
        return []
    cur = await conn.execute(
        sql.SQL(
            "SELECT DISTINCT floor(extract(epoch FROM partition_at) * 1000 / %(ms)s)::bigint k"
            " FROM {} WHERE partition_at < %(before)s ORDER BY k LIMIT %(cap)s"
        ).format(sql.Identifier(DEFAULT)),
        {"ms": interval_ms, "before": before, "cap": MAX_PAST_INTERVALS},
    )
    return [
        dt.datetime.fromtimestamp(int(k) * interval_ms / 1000, dt.UTC)
        for (k,) in await cur.fetchall()
    ]


async def default_rows(
    conn: psycopg.AsyncConnection[Any], cap: int, where: sql.Composable = _EVERY_ROW
) -> int | None:
    """The default partition's rows (those ``where`` selects), counted up to ``cap``; None
    when the outbox is not partitioned. It should hold none: see :func:`create_partition`."""
    if not await _exists(conn, DEFAULT):
        return None
    cur = await conn.execute(
        sql.SQL("SELECT count(*) FROM (SELECT 1 FROM {} WHERE {} LIMIT {}) x").format(
            sql.Identifier(DEFAULT), where, sql.Literal(cap)
        )
    )
    row = await cur.fetchone()
    return int(row[0]) if row else 0


async def pending_since(conn: psycopg.AsyncConnection[Any]) -> dt.datetime | None:
    """The lower bound of the oldest partition holding an unprocessed row, at least one
    interval back from now; None when the outbox is not partitioned or the oldest such
    partition has no lower bound (the one from before the conversion, or the default).
    The claim looks only from there on (``claim_due_partitioned``).

    None too, with a warning (at most every :data:`UNREADABLE_WARNING_S`), when this role
    may not read a partition: the claim then looks everywhere, slower but complete."""
    global _unreadable_warned
    try:
        return await _pending_since(conn)
    except psycopg.errors.InsufficientPrivilege as exc:
        if time.monotonic() - _unreadable_warned >= UNREADABLE_WARNING_S:
            _unreadable_warned = time.monotonic()
            log.warning(
                "outbox partitions not read for the claim's start (%s); the claim looks at"
                " every partition meanwhile: %s",
                described(exc),
                READ_HINT,
            )
        return None


_unreadable_warned = -UNREADABLE_WARNING_S


async def _pending_since(conn: psycopg.AsyncConnection[Any]) -> dt.datetime | None:
    current = await layout(conn)
    if not current.partitioned:
        return None
    assert current.interval_ms is not None
    now = await _db_now(conn)
    floor = _bounds(now, current.interval_ms)[0] - dt.timedelta(milliseconds=current.interval_ms)
    for name, lower, _ in await _partition_ranges(conn):
        cur = await conn.execute(
            sql.SQL("SELECT EXISTS (SELECT 1 FROM ONLY {} WHERE NOT processed)").format(
                sql.Identifier(name)
            )
        )
        row = await cur.fetchone()
        if row and row[0]:
            return None if lower is None else min(lower, floor)
    return floor


async def _partition_ranges(
    conn: psycopg.AsyncConnection[Any],
) -> list[tuple[str, dt.datetime | None, dt.datetime | None]]:
    """Every partition with its range's start and end, oldest first; those without a start
    (the old table: MINVALUE; the default partition) first. None: no such bound (MINVALUE,
    MAXVALUE, the default partition)."""
    cur = await conn.execute(
        "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i"
        " JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = to_regclass(%s)",
        (PARENT,),
    )
    found: list[tuple[str, dt.datetime | None, dt.datetime | None]] = []
    for name, bound in await cur.fetchall():
        texts = [_bound_text(bound, "FROM ('"), _bound_text(bound, " TO ('")]
        lower = upper = None
        if any(texts):
            parsed = await conn.execute("SELECT %s::timestamptz, %s::timestamptz", texts)
            row = await parsed.fetchone()
            if row is not None:
                lower, upper = row
        found.append((str(name), lower, upper))
    oldest = dt.datetime.min.replace(tzinfo=dt.UTC)
    found.sort(key=lambda item: (item[1] is not None, item[1] or oldest))
    return found


def _bound_text(bound: object, marker: str) -> str | None:
    if not isinstance(bound, str) or marker not in bound:
        return None
    return bound.split(marker, 1)[1].split("')", 1)[0]


@dataclass(frozen=True)
class Dropped:
    name: str
    rows: int


async def drop_expired(
    conn: psycopg.AsyncConnection[Any], *, older_than_ms: int, dry_run: bool = False
) -> tuple[list[Dropped], list[str]]:
    """Drop every partition whose range ended before the cutoff (now - ``older_than_ms``)
    and whose rows were all processed before it. Returns (dropped, kept: expired partitions
    still holding an unprocessed or recent row). ``dry_run``: only say which would go.

    Raises :class:`PartitionsNotDropped` when this role may not: only the owner of
    ``webhook_outbox`` may detach and drop its partitions, and a role must be able to read
    them (and how the outbox is partitioned)."""
    try:
        return await _drop_expired(conn, older_than_ms=older_than_ms, dry_run=dry_run)
    except psycopg.errors.InsufficientPrivilege as exc:
        raise PartitionsNotDropped(
            f"outbox partitions not read ({described(exc)}): {READ_HINT}"
        ) from exc


class PartitionsNotDropped(FluxoraError):
    """Retention's partition drops refused: the role is not the owner of the outbox, or may
    not read a partition. The message has PostgreSQL's (the table it names) and what to
    do."""


async def _drop_expired(
    conn: psycopg.AsyncConnection[Any], *, older_than_ms: int, dry_run: bool
) -> tuple[list[Dropped], list[str]]:
    current = await layout(conn)
    if not current.partitioned:
        return [], []
    cutoff = await _cutoff(conn, older_than_ms)
    dropped: list[Dropped] = []
    kept: list[str] = []
    for name, _, upper in await _partition_ranges(conn):
        if upper is None or upper > cutoff or name in (LEGACY, DEFAULT):
            continue
        outcome = await (_droppable if dry_run else _drop_one)(conn, name, cutoff)
        if outcome is None:
            kept.append(name)
        else:
            dropped.append(outcome)
    return dropped, kept


async def _cutoff(conn: psycopg.AsyncConnection[Any], older_than_ms: int) -> dt.datetime:
    """Now - ``older_than_ms`` on the database's clock, as retention's row pruning takes it."""
    cur = await conn.execute(query("retention_cutoff"), {"older_than_ms": older_than_ms})
    row = await cur.fetchone()
    assert row is not None
    cutoff: dt.datetime = row[0]
    return cutoff


async def drop_expired_exclusive(
    conn: psycopg.AsyncConnection[Any],
    *,
    older_than_ms: int,
    dry_run: bool = False,
    wait: bool = False,
    on_wait: Callable[[], None] | None = None,
) -> tuple[list[Dropped], list[str]] | None:
    """:func:`drop_expired` (dropped, kept) under the partitions' session lock (instances
    and the ``prune`` command take turns); None when another holds it now, unless ``wait``
    (it waits, ``on_wait`` called first)."""
    async with session_lock(conn, PARTITION_LOCK_KEY, wait=wait, on_wait=on_wait) as held:
        if not held:
            return None
        return await drop_expired(conn, older_than_ms=older_than_ms, dry_run=dry_run)


async def _drop_one(
    conn: psycopg.AsyncConnection[Any], name: str, cutoff: dt.datetime
) -> Dropped | None:
    """Look, then detach, check again, drop, the last three in one transaction: a row that
    became unprocessed (a replay cannot land there: new rows are written now) is seen while
    nothing can write it. The detach locks the whole outbox (producers' inserts and the
    claims wait), so what is done under it is two lookups in the partial indexes of
    pending and processed rows; the rows are counted (for the log and the metric) before,
    and a partition that must be kept is found so before, without the lock."""
    table = sql.Identifier(name)
    looked = await _droppable(conn, name, cutoff)
    if looked is None:
        return None  # found without a scan, and without the lock
    try:
        async with conn.transaction():
            await conn.execute(f"SET LOCAL lock_timeout = '{DETACH_LOCK_TIMEOUT}'")
            await conn.execute(
                sql.SQL("ALTER TABLE webhook_outbox DETACH PARTITION {}").format(table)
            )
            if await _must_keep(conn, table, cutoff):
                raise _Keep
            await conn.execute(sql.SQL("DROP TABLE {}").format(table))
    except _Keep:
        return None  # rolled back: attached again, untouched
    except psycopg.errors.LockNotAvailable:
        log.info("partition %s not dropped now: the outbox is busy; next run", name)
        return None
    except psycopg.errors.InsufficientPrivilege as exc:  # it was read just before
        raise PartitionsNotDropped(
            f"outbox partitions not dropped ({described(exc)}): {DROP_HINT}"
        ) from exc
    log.info("retention: dropped outbox partition %s (%d processed rows)", name, looked.rows)
    return looked


async def _droppable(
    conn: psycopg.AsyncConnection[Any], name: str, cutoff: dt.datetime
) -> Dropped | None:
    """The partition as it would be dropped (its rows counted), or None when it must stay;
    a look without a lock."""
    table = sql.Identifier(name)
    if await _must_keep(conn, table, cutoff):
        return None
    cur = await conn.execute(sql.SQL("SELECT count(*) FROM {}").format(table))
    counted = await cur.fetchone()
    return Dropped(name, int(counted[0]) if counted else 0)


async def _must_keep(
    conn: psycopg.AsyncConnection[Any], table: sql.Identifier, cutoff: dt.datetime
) -> bool:
    """A partition holding a pending row, or a row processed since the cutoff, stays: two
    lookups in the partial indexes of pending and processed rows, no scan."""
    cur = await conn.execute(
        sql.SQL(
            "SELECT EXISTS (SELECT 1 FROM {t} WHERE NOT processed),"
            " (SELECT max(processed_at) FROM {t} WHERE processed)"
        ).format(t=table)
    )
    row = await cur.fetchone()
    assert row is not None
    unprocessed, last = row
    return bool(unprocessed) or (last is not None and last >= cutoff)


async def whole_partitions(
    conn: psycopg.AsyncConnection[Any], *, older_than_ms: int
) -> tuple[dt.datetime, dt.datetime] | None:
    """On a partitioned outbox, the range of ``partition_at`` that retention drops whole
    rather than row by row: from the start of the first time-range partition whose range
    has not ended by the cutoff (now - ``older_than_ms``; it holds the cutoff) to the end
    of the last. None when the outbox is not partitioned or has no such partition.

    Rows below it (the old table's, an expired partition a pending row keeps) and above it
    (the default partition's) are for :func:`fluxora_webhooks.retention.prune`."""
    if not (await layout(conn)).partitioned:
        return None
    cutoff = await _cutoff(conn, older_than_ms)
    ranged = [
        (lower, upper)
        for name, lower, upper in await _partition_ranges(conn)
        if name not in (LEGACY, DEFAULT) and lower is not None and upper is not None
    ]
    live = [(lower, upper) for lower, upper in ranged if upper > cutoff]
    if not live:
        return None
    return min(lower for lower, _ in live), max(upper for _, upper in live)


class _Keep(Exception):
    """The partition holds a row retention must keep: roll back its detach."""


def describe_maintenance_failure(exc: BaseException) -> str:
    """The error as :func:`~fluxora_webhooks.pgtypes.described` says it, with what to do
    when the role may not create partitions."""
    said = described(exc)
    if isinstance(exc, psycopg.errors.InsufficientPrivilege):
        return f"{said}; {OWNER_HINT}"
    return said


# -- privileges -------------------------------------------------------------------------

# A relation's privileges: (column, or None for the table's own; the grantee's oid, 0 for
# PUBLIC; the privilege) -> whether with the grant option, whoever granted it.
_Acl = dict[tuple[str | None, int, str], bool]


@dataclass(frozen=True)
class _Privileges:
    owner: int
    acl: _Acl
    names: dict[int, str]  # the role names of the oids above (the owner's included)
    columns: frozenset[str]


# Each relation's owner and columns; then its ACL (its owner's default one while it has
# none) and each column's, exploded (one row a grantor, grantee and privilege).
_RELATIONS_QUERY = """
SELECT n, c.relowner::bigint, pg_get_userbyid(c.relowner)::text,
       array(SELECT t.attname::text FROM pg_attribute t
             WHERE t.attrelid = c.oid AND t.attnum > 0 AND NOT t.attisdropped)
FROM unnest(%(names)s::text[]) n JOIN pg_class c ON c.oid = to_regclass(n)
"""
_ACL_QUERY = """
SELECT n, NULL::text, a.grantee::bigint, pg_get_userbyid(a.grantee)::text,
       a.privilege_type, a.is_grantable
FROM unnest(%(names)s::text[]) n
JOIN pg_class c ON c.oid = to_regclass(n)
CROSS JOIN LATERAL aclexplode(coalesce(c.relacl, acldefault('r', c.relowner))) a
UNION ALL
SELECT n, t.attname::text, a.grantee::bigint, pg_get_userbyid(a.grantee)::text,
       a.privilege_type, a.is_grantable
FROM unnest(%(names)s::text[]) n
JOIN pg_attribute t ON t.attrelid = to_regclass(n) AND t.attnum > 0 AND NOT t.attisdropped
CROSS JOIN LATERAL aclexplode(t.attacl) a
"""


async def _read_privileges(
    conn: psycopg.AsyncConnection[Any], names: Sequence[str]
) -> dict[str, _Privileges]:
    """The privileges of those of ``names`` that exist."""
    params = {"names": list(names)}
    cur = await conn.execute(_RELATIONS_QUERY, params)
    relations = {
        name: (owner, owner_name, cols) for name, owner, owner_name, cols in await cur.fetchall()
    }
    acls: dict[str, _Acl] = {name: {} for name in relations}
    roles: dict[str, dict[int, str]] = {
        name: {owner: owner_name} for name, (owner, owner_name, _) in relations.items()
    }
    cur = await conn.execute(_ACL_QUERY, params)
    for name, column, grantee, grantee_name, privilege, grantable in await cur.fetchall():
        if name not in relations:
            continue  # made or dropped between the two reads
        roles[name][grantee] = grantee_name
        key = (column, grantee, privilege)
        acls[name][key] = acls[name].get(key, False) or bool(grantable)
    return {
        name: _Privileges(owner, acls[name], roles[name], frozenset(cols))
        for name, (owner, _, cols) in relations.items()
    }


async def _take_privileges(
    conn: psycopg.AsyncConnection[Any],
    source: str,
    targets: Sequence[str],
    *,
    owner: bool = True,
) -> None:
    """Give each of ``targets`` the privileges ``source`` has: the same for every grantee
    (PUBLIC too), on the table and on each column, with the same grant options; what the
    source's owner has goes to the target's. Those it has and the source has not are
    revoked. With ``owner``, a target first takes the source's owner (a new table is its
    creator's: a superuser's, a member's of the owner's role). The grants are the current
    user's (as the owner's: a grant another grantee made is made again by the owner)."""
    if owner:
        for target in targets:
            await _align_owner(conn, source, target)
    found = await _read_privileges(conn, [source, *targets])
    if source not in found:
        return
    for target in targets:
        if target not in found:
            continue
        want = _mapped(found[source], found[target])
        revokes = _revokes(target, want, found[target].acl, found[target].names)
        for statement in revokes:
            await conn.execute(statement)
        have = (await _read_privileges(conn, [target]))[target] if revokes else found[target]
        for statement in _grants(target, want, have.acl, found[source].names | have.names):
            await conn.execute(statement)


def _mapped(source: _Privileges, target: _Privileges) -> _Acl:
    """The source's privileges as the target's: its owner's are the target's owner's; a
    column the target does not have is left out."""
    acl: _Acl = {}
    for (column, grantee, privilege), grantable in source.acl.items():
        if column is not None and column not in target.columns:
            continue
        key = (column, target.owner if grantee == source.owner else grantee, privilege)
        acl[key] = acl.get(key, False) or grantable
    return acl


def _revokes(target: str, want: _Acl, have: _Acl, names: dict[int, str]) -> list[sql.Composed]:
    statements = []
    for key, grantable in sorted(have.items(), key=_order):
        if key not in want:
            statements.append(_privilege_statement("REVOKE", target, key, names))
        elif grantable and not want[key]:
            statements.append(_privilege_statement("REVOKE GRANT OPTION FOR", target, key, names))
    return statements


def _grants(target: str, want: _Acl, have: _Acl, names: dict[int, str]) -> list[sql.Composed]:
    return [
        _privilege_statement("GRANT", target, key, names, grantable=grantable)
        for key, grantable in sorted(want.items(), key=_order)
        if key not in have or (grantable and not have[key])
    ]


def _order(item: tuple[tuple[str | None, int, str], bool]) -> tuple[str, int, str]:
    (column, grantee, privilege), _ = item
    return (column or "", grantee, privilege)


def _privilege_statement(
    verb: str,
    target: str,
    key: tuple[str | None, int, str],
    names: dict[int, str],
    *,
    grantable: bool = False,
) -> sql.Composed:
    column, grantee, privilege = key
    if not (privilege.isalpha() and privilege.isupper()):  # a keyword, from aclexplode
        raise ValueError(f"unexpected privilege {privilege!r} on {target}")
    who = sql.SQL("PUBLIC") if grantee == 0 else sql.Identifier(names[grantee])
    granting = verb == "GRANT"
    return sql.SQL("{verb} {privilege}{column} ON TABLE {table} {direction} {who}{tail}").format(
        verb=sql.SQL(verb),
        privilege=sql.SQL(privilege),
        column=sql.SQL("") if column is None else sql.SQL(" ({})").format(sql.Identifier(column)),
        table=sql.Identifier(target),
        direction=sql.SQL("TO" if granting else "FROM"),
        who=who,
        tail=sql.SQL((" WITH GRANT OPTION" if grantable else "") if granting else " CASCADE"),
    )


async def _align_owner(conn: psycopg.AsyncConnection[Any], source: str, target: str) -> None:
    """``target`` owned by ``source``'s owner (a table is its creator's). Not possible (the
    current user may not give it to that role): said, and left as it is."""
    cur = await conn.execute(
        "SELECT pg_get_userbyid(s.relowner)::text FROM pg_class s, pg_class t"
        " WHERE s.oid = to_regclass(%s) AND t.oid = to_regclass(%s) AND s.relowner <> t.relowner",
        (source, target),
    )
    row = await cur.fetchone()
    if row is None:
        return
    try:
        async with conn.transaction():
            await conn.execute(
                sql.SQL("ALTER TABLE {} OWNER TO {}").format(
                    sql.Identifier(target), sql.Identifier(row[0])
                )
            )
    except psycopg.errors.InsufficientPrivilege as exc:
        log.warning(
            "%s stays its creator's, not the owner of %s (%s)",
            target,
            source,
            described(exc),
        )


async def _acts_as_owner(conn: psycopg.AsyncConnection[Any]) -> bool:
    """Whether the current user has the outbox owner's rights (the owner, a member of its
    role, a superuser)."""
    cur = await conn.execute(
        "SELECT pg_has_role(relowner, 'USAGE') FROM pg_class WHERE oid = to_regclass(%s)",
        (PARENT,),
    )
    row = await cur.fetchone()
    return bool(row and row[0])


async def _share_config(conn: psycopg.AsyncConnection[Any]) -> None:
    """Every role with a privilege on the outbox may read how it is partitioned (every
    command and the dispatcher read it); nothing else of it."""
    found = await _read_privileges(conn, [PARENT, CONFIG])
    if PARENT not in found or CONFIG not in found:
        return
    parent, config = found[PARENT], found[CONFIG]
    readers = {grantee for _, grantee, _ in parent.acl} - {parent.owner, config.owner}
    want: _Acl = {(None, grantee, "SELECT"): False for grantee in readers}
    for statement in _grants(CONFIG, want, config.acl, parent.names):
        await conn.execute(statement)
