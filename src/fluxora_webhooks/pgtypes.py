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
