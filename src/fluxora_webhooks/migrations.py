"""Versioned schema migrations, recorded in the database and applied under an advisory lock.

Migrations are ``sql/migrations/NNNN_name.sql``; each runs in its own transaction together
with its record in ``fluxora_schema_migrations``. Concurrent ``migrate`` commands serialize
on one advisory lock, so each migration is applied exactly once.

A migration whose first line is :data:`CONCURRENTLY_MARKER` runs outside a transaction, one
statement at a time, and is recorded after its last statement: it builds indexes with
``CREATE INDEX CONCURRENTLY IF NOT EXISTS``, which does not hold off the producers' INSERTs
for the build as a transaction's ``CREATE INDEX`` does. Every statement of such a migration
must be safe to run again: a run interrupted half-way is completed by the next one (an
index an interrupted build left INVALID is dropped and built again). On a partitioned
outbox, where PostgreSQL builds no index concurrently on the parent, the index is created
on the parent alone (``ON ONLY``, no build), built concurrently on each partition and
attached there, which makes the parent's valid.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import secrets
import weakref
import zlib
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import psycopg
import psycopg.conninfo

from . import logs
from .errors import ConfigError, SchemaError
from .pgtypes import open_session

log = logging.getLogger(__name__)

# Arbitrary but fixed: the advisory lock key for "fluxora-webhooks migrations".
MIGRATION_LOCK_KEY = 0x666C75786F7261

_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")

# The first line of a migration that runs outside a transaction, statement by statement.
CONCURRENTLY_MARKER = "-- fluxora: concurrently"
# How often a ``migrate`` waiting for another one's lock asks again (seconds). It asks with
# pg_try_advisory_lock rather than waiting in pg_advisory_lock: a statement waiting for the
# lock holds a snapshot, which an index build of the lock's holder (CONCURRENTLY) waits for.
LOCK_POLL_S = 0.5
# While waiting for it, said this often.
LOCK_WAIT_LOG_S = 30.0
# Creating an index on a partitioned parent alone, and attaching a partition's index to it,
# take short locks: each waits at most this long, then tries again (LOCK_RETRIES times),
# rather than queue the producers' INSERTs behind a long transaction.
BRIEF_LOCK_TIMEOUT = "2s"
LOCK_RETRIES = 30

# A statement of a concurrent migration that builds an index: its parts.
_CONCURRENT_INDEX = re.compile(
    r"^CREATE\s+(?P<unique>UNIQUE\s+)?INDEX\s+CONCURRENTLY\s+IF\s+NOT\s+EXISTS\s+"
    r"(?P<name>[a-z_][a-z0-9_]*)\s+ON\s+(?P<table>[a-z_][a-z0-9_]*)\s+(?P<rest>.+)$",
    re.IGNORECASE | re.DOTALL,
)
_ANY_CONCURRENT = re.compile(r"\bCONCURRENTLY\b", re.IGNORECASE)

_CREATE_TABLE = """
CREATE TABLE IF NOT EXISTS fluxora_schema_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    checksum   text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)
"""


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()

    @property
    def concurrently(self) -> bool:
        """Runs outside a transaction, statement by statement (its first line says so)."""
        first = self.sql.lstrip("\ufeff").split("\n", 1)[0]
        return first.strip() == CONCURRENTLY_MARKER

    def statements(self) -> list[str]:
        """The migration's statements, comments left out (for a concurrent migration)."""
        return split_statements(self.sql)


def split_statements(text: str) -> list[str]:
    """SQL text as its statements: split at each ``;`` outside quotes, ``--`` comments
    removed. Dollar quoting is not read: a concurrent migration holds no function body."""
    statements: list[str] = []
    current: list[str] = []
    i = 0
    quote: str | None = None
    while i < len(text):
        char = text[i]
        if quote is not None:
            current.append(char)
            if char == quote:
                quote = None
        elif char in ("'", '"'):
            quote = char
            current.append(char)
        elif text.startswith("--", i):
            end = text.find("\n", i)
            i = len(text) if end < 0 else end
            continue
        elif text.startswith("$$", i):
            raise SchemaError("a concurrent migration cannot hold dollar-quoted text")
        elif char == ";":
            statements.append("".join(current).strip())
            current = []
        else:
            current.append(char)
        i += 1
    statements.append("".join(current).strip())
    return [s for s in statements if s]


@cache
def available() -> tuple[Migration, ...]:
    """The migrations shipped with this version, in order."""
    folder = resources.files("fluxora_webhooks").joinpath("sql/migrations")
    found = []
    for entry in folder.iterdir():
        match = _FILE.match(entry.name)
        if match:
            found.append(Migration(int(match.group(1)), match.group(2), entry.read_text("utf-8")))
    found.sort(key=lambda m: m.version)
    if [m.version for m in found] != list(range(1, len(found) + 1)):
        raise SchemaError("migration files are not numbered 0001, 0002, ... without gaps")
    return tuple(found)


def latest_version() -> int:
    return available()[-1].version


async def check_encoding(conn: psycopg.AsyncConnection[Any]) -> None:
    """Refuse a database that is not UTF8: with SQL_ASCII, PostgreSQL stores bytes unchecked
    and returns them undecoded, and nothing that reads the outbox could trust its text."""
    cur = await conn.execute("SELECT current_setting('server_encoding')")
    row = await cur.fetchone()
    value = row[0] if row else "?"
    # Under SQL_ASCII psycopg returns text as bytes: the very problem, seen here first.
    encoding = value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)
    if encoding.upper() not in ("UTF8", "UTF-8"):
        raise SchemaError(
            f"the database's encoding is {encoding}; fluxora-webhooks needs a UTF8 database"
            " (CREATE DATABASE ... ENCODING 'UTF8' TEMPLATE template0)"
        )


async def applied_versions(conn: psycopg.AsyncConnection[Any]) -> dict[int, str]:
    """{version: checksum} recorded in the database ({} when never migrated)."""
    cur = await conn.execute("SELECT to_regclass('fluxora_schema_migrations') IS NOT NULL")
    row = await cur.fetchone()
    if not row or not row[0]:
        return {}
    cur = await conn.execute("SELECT version, checksum FROM fluxora_schema_migrations")
    return {int(v): str(c) for v, c in await cur.fetchall()}


async def installed_elsewhere(conn: psycopg.AsyncConnection[Any]) -> str | None:
    """When this session's search_path finds no schema of ours but another schema of the
    database holds one: what to do about it (a role or a URL without the search_path the
    installation was made with; migrating would make a second, empty installation that the
    producers of the other would never reach). Else None."""
    cur = await conn.execute(
        "SELECT n.nspname, current_setting('search_path'),"
        " has_schema_privilege(n.oid, 'USAGE'), session_user FROM pg_class c"
        " JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE c.relname = 'fluxora_schema_migrations' AND c.relkind IN ('r', 'p')"
        " AND n.oid <> pg_my_temp_schema() ORDER BY 1"
    )
    rows = await cur.fetchall()
    if not rows:
        return None
    barred = [str(r[0]) for r in rows if not r[2]]
    if barred and len(barred) == len(rows):
        return (
            f"this role may not use schema {', '.join(barred)}, which holds the"
            f" fluxora-webhooks schema: GRANT USAGE ON SCHEMA {barred[0]} TO {rows[0][3]}"
            ' (docs/operations.md, "Roles and privileges")'
        )
    names = ", ".join(str(r[0]) for r in rows)
    first = rows[0][0]
    return (
        f"no fluxora-webhooks schema on this session's search_path ({rows[0][1]}), but schema"
        f" {names} of this database holds one: add options=-c%20search_path%3D{first} to"
        f" DATABASE_URL (written so in a URL; options='-c search_path={first}' in a"
        " key=value one), or ALTER ROLE ... SET search_path, rather than migrating again"
    )


async def migrate(conn: psycopg.AsyncConnection[Any]) -> list[Migration]:
    """Apply every pending migration; returns those applied (empty when up to date).

    ``conn`` must be in autocommit mode; each migration gets its own transaction.
    """
    applied: list[Migration] = []
    await check_encoding(conn)
    await take_lock(conn)
    try:
        await conn.execute(_CREATE_TABLE)
        done = await applied_versions(conn)
        _check_known(done)
        for migration in available():
            if migration.version in done:
                continue
            if migration.concurrently:
                await _apply_concurrently(conn, migration)
            else:
                async with conn.transaction():
                    await conn.execute(migration.sql.encode())
                    await _record(conn, migration)
            applied.append(migration)
    finally:
        await conn.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK_KEY,))
    return applied


async def take_lock(conn: psycopg.AsyncConnection[Any]) -> None:
    """The migrations' advisory lock (session level), waited for without a statement in
    progress (:data:`LOCK_POLL_S`)."""
    loop = asyncio.get_running_loop()
    started = next_said = loop.time()
    waited = False
    while True:
        cur = await conn.execute("SELECT pg_try_advisory_lock(%s)", (MIGRATION_LOCK_KEY,))
        row = await cur.fetchone()
        if row and row[0]:
            if waited:
                log.info("took the migration lock after %.0fs", loop.time() - started)
            return
        now = loop.time()
        if now >= next_said:
            # A migrate that seems to hang is waiting for another (a concurrent index
            # build on a big outbox takes minutes): said at once, and again now and then.
            log.warning(
                "waiting for the migration lock: another migrate (or --partitioned"
                " conversion) is running on this database (%.0fs so far)",
                now - started,
            )
            next_said = now + LOCK_WAIT_LOG_S
        waited = True
        await asyncio.sleep(LOCK_POLL_S)


async def _record(conn: psycopg.AsyncConnection[Any], migration: Migration) -> None:
    await conn.execute(
        "INSERT INTO fluxora_schema_migrations (version, name, checksum) VALUES (%s, %s, %s)",
        (migration.version, migration.name, migration.checksum),
    )


async def _apply_concurrently(conn: psycopg.AsyncConnection[Any], migration: Migration) -> None:
    """Each statement in autocommit, then the record: interrupted, nothing is recorded and
    the next ``migrate`` runs the whole migration again."""
    for statement in migration.statements():
        found = _CONCURRENT_INDEX.match(statement)
        if found is None:
            if _ANY_CONCURRENT.search(statement):
                raise SchemaError(
                    f"migration {migration.version:04d}_{migration.name}: an index built"
                    " CONCURRENTLY must be CREATE [UNIQUE] INDEX CONCURRENTLY IF NOT EXISTS"
                    " <name> ON <table> ..., to be run again after an interruption"
                )
            await conn.execute(statement.encode())
            continue
        unique = "UNIQUE " if found["unique"] else ""
        name, table, rest = found["name"], found["table"], found["rest"]
        if await _relkind(conn, table) == "p":
            await _partitioned_index(conn, unique, name, table, rest)
        else:
            await _drop_if_invalid(conn, name)
            await conn.execute(statement.encode())
    await _record(conn, migration)


async def _relkind(conn: psycopg.AsyncConnection[Any], name: str) -> str | None:
    cur = await conn.execute(
        "SELECT relkind::text FROM pg_class WHERE oid = to_regclass(%s)", (name,)
    )
    row = await cur.fetchone()
    return str(row[0]) if row else None


async def _index_valid(conn: psycopg.AsyncConnection[Any], name: str) -> bool | None:
    """Whether the index is valid; None when there is none of that name."""
    cur = await conn.execute(
        "SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass(%s)", (name,)
    )
    row = await cur.fetchone()
    return None if row is None else bool(row[0])


async def _drop_if_invalid(conn: psycopg.AsyncConnection[Any], name: str) -> None:
    """An index a build left INVALID (interrupted: cancelled, timed out, the connection
    lost) is dropped, so that ``IF NOT EXISTS`` builds it again rather than keep it."""
    if await _index_valid(conn, name) is False:
        log.warning("index %s was left invalid by an interrupted build: building it again", name)
        await conn.execute(f'DROP INDEX CONCURRENTLY IF EXISTS "{name}"'.encode())


async def _briefly(conn: psycopg.AsyncConnection[Any], statement: str) -> None:
    """A statement that takes a short lock, waiting for it :data:`BRIEF_LOCK_TIMEOUT` at a
    time: never a long queue in front of the producers' INSERTs."""
    for attempt in range(LOCK_RETRIES):
        try:
            async with conn.transaction():
                await conn.execute(f"SET LOCAL lock_timeout = '{BRIEF_LOCK_TIMEOUT}'")
                await conn.execute(statement.encode())
            return
        except psycopg.errors.LockNotAvailable:
            if attempt == LOCK_RETRIES - 1:
                raise
            await asyncio.sleep(min(5.0, 0.2 * (attempt + 1)))


def partition_index_name(name: str, table: str, partition: str) -> str:
    """The name of index ``name`` (of ``table``) on one of its partitions: the partition's
    name and the index's own part, within PostgreSQL's 63 bytes."""
    suffix = name.removeprefix(table + "_")
    full = f"{partition}_{suffix}"
    if len(full) <= 63:
        return full
    return f"{full[:54]}_{zlib.crc32(full.encode()):08x}"


async def _partitioned_index(
    conn: psycopg.AsyncConnection[Any], unique: str, name: str, table: str, rest: str
) -> None:
    """The index on a partitioned table: on the parent alone (no build, invalid until each
    partition has its own attached), then built concurrently on each partition that has
    none yet and attached. A partition created meanwhile gets it from the parent. Loops
    until the parent's is valid."""
    await _briefly(conn, f"CREATE {unique}INDEX IF NOT EXISTS {name} ON ONLY {table} {rest}")
    for _ in range(LOCK_RETRIES):
        if await _index_valid(conn, name):
            return
        cur = await conn.execute(
            "SELECT c.relname::text, c.relkind::text FROM pg_inherits i"
            " JOIN pg_class c ON c.oid = i.inhrelid"
            " WHERE i.inhparent = to_regclass(%s)"
            " AND NOT EXISTS (SELECT 1 FROM pg_inherits x JOIN pg_index ix"
            "   ON ix.indexrelid = x.inhrelid"
            "   WHERE x.inhparent = to_regclass(%s) AND ix.indrelid = c.oid)"
            " ORDER BY c.relname",
            (table, name),
        )
        for partition, kind in await cur.fetchall():
            if kind == "p":
                raise SchemaError(
                    f"{partition} is partitioned in turn: index {name} cannot be built"
                    " concurrently there"
                )
            own = partition_index_name(name, table, partition)
            await _drop_if_invalid(conn, own)
            build = f"CREATE {unique}INDEX CONCURRENTLY IF NOT EXISTS {own} ON {partition} {rest}"
            await conn.execute(build.encode())
            await _briefly(conn, f"ALTER INDEX {name} ATTACH PARTITION {own}")
    if not await _index_valid(conn, name):
        raise SchemaError(f"index {name} is not valid on every partition of {table}")


def _check_known(done: dict[int, str]) -> None:
    known = {m.version: m for m in available()}
    newer = sorted(v for v in done if v not in known)
    if newer:
        raise SchemaError(
            f"the database schema is at version {max(done)}, newer than this fluxora-webhooks"
            f" supports ({latest_version()}); upgrade fluxora-webhooks"
        )
    for version, checksum in done.items():
        if known[version].checksum != checksum:
            raise SchemaError(
                f"migration {version:04d}_{known[version].name} was changed after it was"
                " applied to this database"
            )


# What to do about a read-only database, in every message that reports one.
READ_ONLY_HINT = (
    "DATABASE_URL must reach a database that accepts writes, the primary (with several"
    " hosts, add target_session_attrs=read-write)"
)


class _Discarded(logging.Filter):
    """Drops psycopg_pool's "discarding closed connection" warning for a connection closed
    on purpose by :func:`discard` (on a standby it came once a claim loop's retry)."""

    def __init__(self) -> None:
        super().__init__()
        self.closed: weakref.WeakSet[psycopg.AsyncConnection[Any]] = weakref.WeakSet()

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (args and args[0] in self.closed)


_DISCARDED = _Discarded()
logging.getLogger("psycopg.pool").addFilter(_DISCARDED)


async def discard(conn: psycopg.AsyncConnection[Any]) -> None:
    """Close a pool's connection that found the database read-only, before it goes back
    to its pool: the pool opens another, which a multi-host URL with
    target_session_attrs=read-write leads to the primary (and which a database switched
    back to read-write serves as such). Closed on purpose, so not warned about."""
    _DISCARDED.closed.add(conn)
    await conn.close()


async def read_only_reason(conn: psycopg.AsyncConnection[Any]) -> str | None:
    """Why the database refuses writes (a standby in recovery, or read-only by its
    ``default_transaction_read_only``, as a managed server whose storage is full is
    switched), or None when it accepts them. ``conn`` must be in autocommit: its
    ``transaction_read_only`` is then the session's default."""
    cur = await conn.execute(
        "SELECT pg_is_in_recovery(), current_setting('transaction_read_only') = 'on'"
    )
    row = await cur.fetchone()
    if row is None:
        return None
    if row[0]:
        return "a standby in recovery"
    return "default_transaction_read_only is on" if row[1] else None


# libpq's account of one host of a multi-host URL: "- host: 'h', port: 'p', ...: ...
# failed: <why>".
_HOST_FAILED = re.compile(r"- host: '([^']*)', port: '([^']*)'.*failed: (.*)$")


def each_host_failed(text: str) -> str | None:
    """For a multi-host URL whose hosts all failed (``text``: the connection error's),
    each host and why, "every host failed: h1:p1 (why); h2:p2 (why)" (the error's first
    line names only the last one tried); None otherwise."""
    found = [_HOST_FAILED.match(line.strip()) for line in text.splitlines()]
    hosts = [f"{m[1]}:{m[2]} ({m[3].strip()})" for m in found if m]
    return "every host failed: " + "; ".join(hosts) if len(hosts) > 1 else None


def unreachable_reason(exc: BaseException) -> str:
    """/readyz's reason when no connection to the database was made: each host and why
    when every host of a multi-host URL failed (during a failover with
    target_session_attrs=read-write: one refused, another read-only), else the error's
    kind. Hosts, ports and libpq's reasons only: never the URL or its password."""
    hosts = each_host_failed(str(exc)) if isinstance(exc, psycopg.OperationalError) else None
    return f"database unreachable ({logs.scrub(hosts) if hosts else type(exc).__name__})"


# How long a NOTIFY this process sends itself may take to arrive before the connection is
# taken for one through a pooler in transaction mode: it arrives in milliseconds otherwise.
POOLER_PROBE_S = 5.0
POOLER_HINT = (
    "DATABASE_URL goes through a connection pooler in transaction mode (PgBouncer's"
    " pool_mode=transaction, say), which this command cannot use: it needs its session's"
    " LISTEN, locks and settings. Point DATABASE_URL at PostgreSQL or at a pool in session"
    ' mode (docs/scaling.md, "Connection poolers")'
)


async def check_session_pooling(conn: psycopg.AsyncConnection[Any], conninfo: str) -> None:
    """Raise :class:`ConfigError` unless a NOTIFY sent from another connection reaches this
    one's LISTEN within :data:`POOLER_PROBE_S`: through a pooler in transaction mode it
    never does (the server's notice has no client to go to between transactions), and
    neither do the producers' wake-ups; its session advisory locks do not exclude, and its
    session settings reach other clients of the pool. ``conn`` is in autocommit."""
    cur = await conn.execute(
        "SELECT pg_is_in_recovery() OR current_setting('transaction_read_only')::bool"
    )
    row = await cur.fetchone()
    if row and row[0]:
        # A standby refuses LISTEN and NOTIFY: an API or a command that reads from one is
        # let through (read_only_reason says what a writer finds there).
        log.debug("the pooler check is skipped: the database is read-only")
        return
    channel = f"fluxora_probe_{secrets.token_hex(8)}"
    await conn.execute(f"LISTEN {channel}")
    try:
        # The server this connection reached, whatever else a multi-host URL names.
        pinned = {"host": conn.info.host, "port": str(conn.info.port)}
        if "hostaddr" in psycopg.conninfo.conninfo_to_dict(conninfo):
            pinned["hostaddr"] = conn.info.hostaddr
        here = psycopg.conninfo.make_conninfo(conninfo, **pinned)
        async with await open_session(here, autocommit=True, connect_timeout=10) as other:
            await other.execute("SELECT pg_notify(%s, '')", (channel,))
        arrived = [n async for n in conn.notifies(timeout=POOLER_PROBE_S, stop_after=1)]
    finally:
        await conn.execute(f"UNLISTEN {channel}")
    if not arrived:
        raise ConfigError(
            "DATABASE_URL",
            f"a NOTIFY sent to this connection did not arrive within {POOLER_PROBE_S:.0f} s: "
            + POOLER_HINT,
        )


# What the dispatcher writes and reads (docs/operations.md, "Roles and privileges", whose
# dispatcher block grants exactly these): without one, batches failed after their requests
# and were sent again, or a dead letter could not be written and its delivery was sent for
# ever, while /readyz said ready.
DISPATCHER_PRIVILEGES = (
    ("webhook_outbox", ("SELECT", "INSERT", "UPDATE")),
    ("webhook_builtin_seen", ("SELECT", "INSERT", "UPDATE")),
    ("webhook_endpoints", ("SELECT", "INSERT", "UPDATE", "DELETE")),
    ("webhook_dead_letter", ("SELECT", "INSERT")),
)
DISPATCHER_SEQUENCES = ("webhook_outbox_id_seq", "webhook_dead_letter_id_seq")


async def check_dispatcher_privileges(conn: psycopg.AsyncConnection[Any]) -> None:
    """Raise :class:`ConfigError` naming each privilege the session's role lacks of
    :data:`DISPATCHER_PRIVILEGES` (and USAGE of :data:`DISPATCHER_SEQUENCES`)."""
    wanted = [
        (table, privilege)
        for table, privileges in DISPATCHER_PRIVILEGES
        for privilege in privileges
    ]
    cur = await conn.execute(
        "SELECT w.t, w.p FROM unnest(%s::text[], %s::text[]) AS w(t, p)"
        " WHERE NOT has_table_privilege(w.t, w.p)"
        " UNION ALL SELECT s, 'USAGE' FROM unnest(%s::text[]) AS s"
        " WHERE NOT has_sequence_privilege(s, 'USAGE')",
        ([t for t, _ in wanted], [p for _, p in wanted], list(DISPATCHER_SEQUENCES)),
    )
    missing = await cur.fetchall()
    if not missing:
        return
    role = await (await conn.execute("SELECT session_user")).fetchone()
    said = "; ".join(f"{p} on {t}" for t, p in missing)
    raise ConfigError(
        "DATABASE_URL",
        f"its role {role[0] if role else '?'} may not do what the dispatcher does ({said}):"
        ' grant it the privileges of docs/operations.md, "Roles and privileges"',
    )


async def check_schema(conn: psycopg.AsyncConnection[Any]) -> None:
    """Raise :class:`SchemaError` unless the schema is exactly what this code expects."""
    await check_encoding(conn)
    done = await applied_versions(conn)
    if not done:
        elsewhere = await installed_elsewhere(conn)
        if elsewhere:
            raise SchemaError(elsewhere)
        raise SchemaError(
            "the database has no fluxora-webhooks schema; run `fluxora-webhooks migrate` first"
        )
    _check_known(done)
    missing = [m for m in available() if m.version not in done]
    if missing:
        raise SchemaError(
            f"the database schema is at version {max(done)}, this fluxora-webhooks needs"
            f" {latest_version()}; run `fluxora-webhooks migrate`"
        )
    shadowed = await shadowed_tables(conn)
    if shadowed:
        raise SchemaError(shadowed)


# Our tables (beside the migrations' record) that the session's search_path finds in
# another schema than the installation's.
_SHADOWED = """
SELECT n.nspname, c.relname, rn.nspname, current_setting('search_path')
FROM pg_class m
JOIN pg_namespace n ON n.oid = m.relnamespace
JOIN pg_class c ON c.relnamespace = m.relnamespace AND c.relkind IN ('r', 'p')
    AND NOT c.relispartition AND left(c.relname, 8) = 'webhook_'
JOIN pg_class r ON r.oid = to_regclass(quote_ident(c.relname))
JOIN pg_namespace rn ON rn.oid = r.relnamespace
WHERE m.oid = to_regclass('fluxora_schema_migrations') AND r.oid <> c.oid
ORDER BY c.relname
"""


async def shadowed_tables(conn: psycopg.AsyncConnection[Any]) -> str | None:
    """When a schema ahead of the installation's on this session's search_path has tables
    of the same names (a DBA's ``ALTER ROLE|DATABASE ... SET search_path``): what is
    wrong. Otherwise every statement read and wrote those tables, failing on a column
    they lack (`run` logged a traceback per claim, for ever) or, worse, not failing."""
    cur = await conn.execute(_SHADOWED)
    rows = await cur.fetchall()
    if not rows:
        return None
    home, path = str(rows[0][0]), str(rows[0][3])
    names = ", ".join(f"{other}.{name}" for _, name, other, _ in rows[:3])
    more = f" and {len(rows) - 3} more" if len(rows) > 3 else ""
    return (
        f"this session's search_path ({path}) finds {names}{more} ahead of the"
        f" fluxora-webhooks tables of schema {home}: put {home} first on the search_path"
        f" (options=-c%20search_path%3D{home} in DATABASE_URL, or ALTER ROLE ... SET"
        " search_path), or rename those tables"
    )
