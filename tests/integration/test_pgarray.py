"""The array literals a batch's statements take (pgarray) read back in PostgreSQL as the
values they were built from: every character a response body or an error may hold, NULLs,
numbers at their limits, times in any offset."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest

from fluxora_webhooks import pgarray

pytestmark = pytest.mark.integration

TEXTS: list[str | None] = [
    "plain",
    "",
    "NULL",
    "null",
    'a "quoted" word',
    "back\\slash\\",
    "{braces}",
    "a,b",
    "  spaces  ",
    "line\nbreak\ttab\r",
    "é ünïcødé ✓ 𝄞",
    "'single' quotes",
    '\\"',
    None,
]


async def _read(url: str, sql: str, literal: str) -> Any:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(sql, (literal,))
        row = await cur.fetchone()
        assert row is not None
        return row[0]


async def test_text_arrays_read_back_as_written(database_url: str) -> None:
    assert await _read(database_url, "SELECT %s::text[]", pgarray.texts(TEXTS)) == TEXTS
    assert await _read(database_url, "SELECT %s::text[]", pgarray.texts([])) == []


async def test_number_arrays_read_back_as_written(database_url: str) -> None:
    ints = [0, -1, 2**63 - 1, -(2**63), None, 42]
    assert await _read(database_url, "SELECT %s::bigint[]", pgarray.ints(ints)) == ints
    floats = [0.0, 1.5, -2.25, 1e-9, 123456789.123, None]
    assert await _read(database_url, "SELECT %s::float8[]", pgarray.floats(floats)) == floats
    odd = await _read(
        database_url, "SELECT %s::float8[]", pgarray.floats([float("inf"), float("-inf")])
    )
    assert odd == [float("inf"), float("-inf")]


async def test_uuid_and_time_arrays_read_back_as_written(database_url: str) -> None:
    ids = [uuid.uuid4(), None, uuid.uuid4()]
    assert await _read(database_url, "SELECT %s::uuid[]", pgarray.uuids(ids)) == ids
    times = [
        datetime(2026, 12, 3, 7, 0, 0, 123456, tzinfo=UTC),
        datetime(2026, 6, 1, 23, 59, 59, tzinfo=timezone(timedelta(hours=-5, minutes=-30))),
        None,
    ]
    got = await _read(database_url, "SELECT %s::timestamptz[]", pgarray.timestamps(times))
    assert got == times


def test_a_time_without_a_zone_is_refused() -> None:
    with pytest.raises(ValueError, match="time zone"):
        pgarray.timestamps([datetime(2026, 12, 3)])


def test_a_string_that_is_not_a_uuid_is_refused() -> None:
    with pytest.raises(ValueError):
        pgarray.uuids(['x"}'])
