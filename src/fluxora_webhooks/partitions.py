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
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

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
    now: dt.datetime = row[0]
    return now


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
    nobody writes to meanwhile (a new installation, a test)."""
    if not MIN_INTERVAL_MS <= interval_ms <= 31 * 86_400_000:
        raise ValueError("the partition interval must be from 1h to 31d")
    if (await layout(conn)).partitioned:
        return False
    if first_partition_at is None and await _convert_empty(conn, interval_ms):
        await ensure_ahead(conn)
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
    await ensure_ahead(conn)
    return True


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
    start = _bounds(now, current.interval_ms)[0]
    if row and row[0] and row[0] > start:
        start = row[0]
    created = []
    lower = start
    while lower < now + interval * ahead:
        name = await create_partition(conn, lower, current.interval_ms)
        if name is not None:
            created.append(name)
        lower += interval
    if created:
        log.info("outbox partitions created: %s", ", ".join(created))
    return created


async def create_partition(
    conn: psycopg.AsyncConnection[Any], lower: dt.datetime, interval_ms: int
) -> str | None:
    """The partition of ``[lower, lower + interval)``, unless it exists. Returns its name
    when created."""
    name = partition_name(lower)
    if await _exists(conn, name):
        return None
    upper = lower + dt.timedelta(milliseconds=interval_ms)
    in_range = sql.SQL("partition_at >= {} AND partition_at < {}").format(
        sql.Literal(lower), sql.Literal(upper)
    )
    if not await default_rows(conn, 1, in_range):
        await conn.execute(
            sql.SQL(
                "CREATE TABLE {} PARTITION OF webhook_outbox FOR VALUES FROM ({}) TO ({}) WITH ({})"
            ).format(
                sql.Identifier(name), sql.Literal(lower), sql.Literal(upper), sql.SQL(_AUTOVACUUM)
            )
        )
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
    The claim looks only from there on (``claim_due_partitioned``)."""
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
    still holding an unprocessed or recent row). ``dry_run``: only say which would go."""
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
    conn: psycopg.AsyncConnection[Any], *, older_than_ms: int, dry_run: bool = False
) -> list[Dropped] | None:
    """:func:`drop_expired` under the partitions' session lock (instances and the
    ``prune`` command take turns); None when another holds it now."""
    async with session_lock(conn, PARTITION_LOCK_KEY) as held:
        if not held:
            return None
        dropped, _ = await drop_expired(conn, older_than_ms=older_than_ms, dry_run=dry_run)
    return dropped


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
