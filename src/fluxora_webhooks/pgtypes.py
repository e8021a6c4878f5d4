"""Reading what a producer may write that Python cannot hold.

A due time (``created_at``) is any ``timestamptz`` a producer's INSERT gives, but Python's
``datetime`` holds the years 1 to 9999 only: psycopg refuses ``-infinity``, a time before
year 1 or after 9999 as it reads the row (``DataError``), and the claim that read it rolled
back, claiming the same row again, for as long as it stayed: one row stopped every
delivery. Read on the dispatcher's connections, such a time is the earliest or the latest
``datetime`` instead (UTC), so the row is sent like any other (``-infinity`` is simply
due).
"""

from __future__ import annotations

import os
from datetime import UTC, datetime
from typing import Any

import psycopg
import psycopg.conninfo
from psycopg.adapt import Loader
from psycopg.pq import Format

_EARLIEST = datetime.min.replace(tzinfo=UTC)
_LATEST = datetime.max.replace(tzinfo=UTC)


class _LenientTimestamptzLoader(Loader):
    """psycopg's own loader (its C one where installed), with times out of Python's range
    read as the earliest or the latest ``datetime`` rather than refused."""

    inner: type[Loader]

    def __init__(self, oid: int, context: Any = None) -> None:
        super().__init__(oid, context)
        self._inner = self.inner(oid, context)

    def load(self, data: Any) -> datetime:
        try:
            value: datetime = self._inner.load(data)
        except psycopg.DataError:
            text = bytes(data)
            return _EARLIEST if text.startswith(b"-") or text.endswith(b" BC") else _LATEST
        return value


def as_utc(moment: datetime) -> datetime:
    """``moment`` in UTC, for arithmetic and comparisons. A time read from the database
    carries the session's TimeZone, and Python adds to, subtracts and compares two times of
    one time zone on the wall clock: across a DST change of that zone a day is 23 or 25
    hours and the repeated hour compares out of order. A time UTC cannot hold (a producer's
    due time at the edge of year 1 or 9999) is left as psycopg gave it, with a fixed offset
    that Python compares exactly."""
    try:
        return moment.astimezone(UTC)
    except OverflowError:
        return moment


class TooDeep:
    """What a ``json``/``jsonb`` value nested deeper than Python's JSON reader goes (about
    1,000 levels) is read as on a connection of :func:`read_deep_json`."""

    def __repr__(self) -> str:
        return "TOO_DEEP"


TOO_DEEP = TooDeep()


def read_deep_json(conn: psycopg.AsyncConnection[Any]) -> None:
    """Make ``conn`` read a JSON value too deep for ``json.loads`` as :data:`TOO_DEEP`: its
    ``RecursionError`` failed the whole statement (a SQL producer's payload made every list
    of the API it was on answer 500)."""
    from psycopg.types.json import JsonbLoader, JsonLoader

    for name, base in (("json", JsonLoader), ("jsonb", JsonbLoader)):

        class _Lenient(base):  # type: ignore[valid-type,misc]
            def load(self, data: Any) -> Any:
                try:
                    return super().load(data)
                except RecursionError:
                    return TOO_DEEP

        conn.adapters.register_loader(name, _Lenient)


def read_far_timestamps(conn: psycopg.AsyncConnection[Any]) -> None:
    """Make ``conn`` read out-of-range ``timestamptz`` values as above (text format, which
    the dispatcher's statements use)."""
    oid = conn.adapters.types["timestamptz"].oid
    inner = conn.adapters.get_loader(oid, Format.TEXT)
    if inner is None or issubclass(inner, _LenientTimestamptzLoader):
        return
    lenient = type(
        "LenientTimestamptzLoader",
        (_LenientTimestamptzLoader,),
        {"inner": inner, "__module__": __name__},
    )
    conn.adapters.register_loader(oid, lenient)


def session_name(conninfo: str, name: str) -> dict[str, Any]:
    """``application_name`` for our sessions (``pg_stat_activity`` tells the dispatcher's
    and the API's from the producers'), unless the URL or PGAPPNAME names them already (the
    operator's choice stands). Connection options for psycopg."""
    try:
        given = "application_name" in psycopg.conninfo.conninfo_to_dict(conninfo)
    except psycopg.ProgrammingError:
        given = False  # refused at connect time, with the reason
    if given or os.environ.get("PGAPPNAME"):
        return {}
    return {"application_name": name}


# What every session of ours sets, whatever the server, the database or the role has as
# its default (docs/operations.md, "What the database may have set"): the one DateStyle
# psycopg reads times in (under 'SQL, DMY' every command that read a time failed, some
# after writing: a token or an endpoint made and its secret never shown); READ COMMITTED,
# which the claim's SKIP LOCKED, the completion and every read-modify-write are written
# for (under SERIALIZABLE a third of the batches failed and were sent again); floats read
# whole (extra_float_digits below 1 rounds them in text); text in UTF-8 (a client_encoding
# of LATIN1 made every claim of a payload holding an emoji fail, the batch claimed again for
# ever, and the CLI's `send` and the API's events store such text as mojibake or refuse it).
SESSION_SETTINGS = (
    ("DateStyle", "ISO"),
    ("default_transaction_isolation", "read committed"),
    ("extra_float_digits", "1"),
    ("client_encoding", "UTF8"),
)
# Each set only where the session's differs (a DateStyle of ISO with any order, 1 or more
# float digits, are as good): a default session sets nothing, so nothing of ours reaches
# other clients of a pool that hands sessions around.
_DIFFERS = {
    # (No "%" in the text: it goes into statements with parameters.)
    "DateStyle": "left(current_setting('DateStyle'), 3) <> 'ISO'",
    "default_transaction_isolation": (
        "current_setting('default_transaction_isolation') <> 'read committed'"
    ),
    "extra_float_digits": "current_setting('extra_float_digits')::int < 1",
    "client_encoding": "current_setting('client_encoding') <> 'UTF8'",
}
SESSION_SETTINGS_SQL = ", ".join(
    f"CASE WHEN {_DIFFERS[name]} THEN set_config('{name}', '{value}', false) END"
    for name, value in SESSION_SETTINGS
)


async def configure_session(conn: psycopg.AsyncConnection[Any]) -> None:
    """Apply :data:`SESSION_SETTINGS` to ``conn`` (one round trip; committed when the
    connection is not in autocommit, so they outlive the transaction it began)."""
    await conn.execute(f"SELECT {SESSION_SETTINGS_SQL}")
    if not conn.autocommit:
        await conn.commit()


async def open_session(
    conninfo: str, *, name: str | None = None, **options: Any
) -> psycopg.AsyncConnection[Any]:
    """A connection of ours (``options`` are psycopg's), configured by
    :func:`configure_session`, named ``name`` in ``pg_stat_activity`` as
    :func:`session_name` allows; psycopg prepares none of its statements unless
    ``prepare_threshold`` is given (what such a connection runs is not its hot path, and a
    pooler in transaction mode hands a prepared statement's name to other sessions)."""
    options.setdefault("prepare_threshold", None)
    if name is not None:
        options = {**session_name(conninfo, name), **options}
    conn = await psycopg.AsyncConnection.connect(conninfo, **options)
    try:
        await configure_session(conn)
    except BaseException:
        await conn.close()
        raise
    return conn


def described(exc: BaseException) -> str:
    """A database error as a log line says it: its kind, and for a missing privilege
    PostgreSQL's own words, which name the table (or ``must be owner of ...``) and hold no
    data (other errors' may hold a row's values, so only their kind is said)."""
    kind = type(exc).__name__
    if isinstance(exc, psycopg.errors.InsufficientPrivilege):
        said = (exc.diag.message_primary or str(exc)).strip().splitlines()
        return f"{kind}: {said[0][:200]}" if said else kind
    return kind
