"""PostgreSQL array literals, built here for the arrays a batch's statements take.

psycopg dumps a list element by element through its adapters, about a microsecond an
element (a timestamp about five): the completion statement of a batch of ten spent 95-220
us of the dispatcher's CPU building and dumping its fifteen arrays, more than its round
trip. Joined here as one string each, they cost 32-83 us (``benchmarks/params.py``); the
statement casts each literal to its array type (``$1::bigint[]``), which PostgreSQL reads
as it reads any array literal, at the same cost to the database.

Every element is quoted unless it is a number or NULL (``None``), so no text can end an
element or the array early: a double quote and a backslash are the only characters a
quoted element escapes.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any


def _array(values: Iterable[Any], element: Callable[[Any], str]) -> str:
    """``{a,b,...}``: each of ``values`` written by ``element`` (``None`` as NULL)."""
    return "{" + ",".join("NULL" if v is None else element(v) for v in values) + "}"


def ints(values: Iterable[int | None]) -> str:
    """``{1,NULL,3}`` for a ``bigint[]`` / ``int[]``."""
    return _array(values, _int)


def _int(v: int) -> str:
    return str(int(v))


def floats(values: Iterable[float | None]) -> str:
    """A ``float8[]`` literal (``Infinity``/``NaN`` spelt as PostgreSQL spells them)."""
    return _array(values, _float)


def _float(v: float) -> str:
    f = float(v)
    if math.isfinite(f):
        return repr(f)
    return "NaN" if math.isnan(f) else ("Infinity" if f > 0 else "-Infinity")


def texts(values: Iterable[str | None]) -> str:
    """A ``text[]`` literal: each element quoted, ``"`` and ``\\`` escaped."""
    return _array(values, _text)


def _text(v: str) -> str:
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def uuids(values: Iterable[uuid.UUID | str | None]) -> str:
    """A ``uuid[]`` literal."""
    return _array(values, _uuid)


def _uuid(v: uuid.UUID | str) -> str:
    return f'"{v if isinstance(v, uuid.UUID) else uuid.UUID(v)}"'


def timestamps(values: Iterable[datetime | None]) -> str:
    """A ``timestamptz[]`` literal (ISO 8601, with the offset of each aware datetime)."""
    return _array(values, _timestamp)


def _timestamp(v: datetime) -> str:
    if v.tzinfo is None:
        raise ValueError(f"a timestamptz element needs a time zone: {v!r}")
    return f'"{v.isoformat()}"'
