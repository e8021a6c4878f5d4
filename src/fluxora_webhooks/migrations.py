"""Versioned schema migrations, recorded in the database and applied under an advisory lock.

Migrations are ``sql/migrations/NNNN_name.sql``; each runs in its own transaction together
with its record in ``fluxora_schema_migrations``. Concurrent ``migrate`` commands serialize
on one advisory lock, so each migration is applied exactly once.
"""

from __future__ import annotations

import hashlib
import logging
import re
import weakref
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import psycopg

from . import logs
from .errors import SchemaError

# Arbitrary but fixed: the advisory lock key for "fluxora-webhooks migrations".
MIGRATION_LOCK_KEY = 0x666C75786F7261

_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")

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


async def migrate(conn: psycopg.AsyncConnection[Any]) -> list[Migration]:
    """Apply every pending migration; returns those applied (empty when up to date).

    ``conn`` must be in autocommit mode; each migration gets its own transaction.
    """
    applied: list[Migration] = []
    await check_encoding(conn)
    await conn.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK_KEY,))
    try:
        await conn.execute(_CREATE_TABLE)
        done = await applied_versions(conn)
        _check_known(done)
        for migration in available():
            if migration.version in done:
                continue
            async with conn.transaction():
                await conn.execute(migration.sql.encode())
                await conn.execute(
                    "INSERT INTO fluxora_schema_migrations (version, name, checksum)"
                    " VALUES (%s, %s, %s)",
                    (migration.version, migration.name, migration.checksum),
                )
            applied.append(migration)
    finally:
        await conn.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK_KEY,))
    return applied


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


async def check_schema(conn: psycopg.AsyncConnection[Any]) -> None:
    """Raise :class:`SchemaError` unless the schema is exactly what this code expects."""
    await check_encoding(conn)
    done = await applied_versions(conn)
    if not done:
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
