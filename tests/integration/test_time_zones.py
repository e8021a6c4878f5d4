"""A database whose TimeZone has daylight saving time (``ALTER DATABASE ... SET TimeZone``,
as operators set it for their own reasons): psycopg reads every time in that zone, and
Python adds, subtracts and compares two times of one zone on the wall clock. What is
computed from such times (partition bounds, ``tail``'s position, a claim's position, the
demo's failure streak) is right across a DST change all the same."""

from __future__ import annotations

import datetime as dt
import itertools
import math
import re
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any
from zoneinfo import ZoneInfo

import psycopg
import pytest
import pytest_asyncio
from psycopg import sql

from fluxora_webhooks import endpoints, partitions
from fluxora_webhooks.batch import ClaimFront
from fluxora_webhooks.demo.checks import auto_disabled
from fluxora_webhooks.outbox import Claimed
from fluxora_webhooks.tooling import AttemptCursor

pytestmark = pytest.mark.integration

LONDON = "Europe/London"
DAY = 86_400_000
UTC = dt.UTC
# Europe/London's changes of 2025 (UTC): clocks forward at 01:00 on 30 March (01:00 GMT is
# 02:00 BST), back at 01:00 on 26 October (01:59:59 BST is followed by 01:00:00 GMT).
SPRING_2025 = dt.datetime(2025, 3, 30, 1, 0, tzinfo=UTC)
AUTUMN_2025 = dt.datetime(2025, 10, 26, 1, 0, tzinfo=UTC)


@pytest_asyncio.fixture
async def london(database_url: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """A connection to a database whose TimeZone is Europe/London."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        name = conn.info.dbname
        await conn.execute(
            sql.SQL("ALTER DATABASE {} SET TimeZone = 'Europe/London'").format(sql.Identifier(name))
        )
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        cur = await conn.execute("SHOW TimeZone")
        assert (await cur.fetchone()) == (LONDON,)
        yield conn


def _next_change(zone: ZoneInfo, after: dt.datetime) -> dt.datetime:
    """The first whole UTC hour after ``after`` at which ``zone``'s offset changes."""
    hour = after.replace(minute=0, second=0, microsecond=0) + dt.timedelta(hours=1)
    for _ in range(24 * 400):
        if (
            hour.astimezone(zone).utcoffset()
            != (hour - dt.timedelta(hours=1)).astimezone(zone).utcoffset()
        ):
            return hour
        hour += dt.timedelta(hours=1)
    raise AssertionError(f"{zone} changes its offset in no hour of the next 400 days")


async def _ranges(conn: psycopg.AsyncConnection[Any]) -> dict[str, tuple[dt.datetime, dt.datetime]]:
    cur = await conn.execute(
        "SELECT c.relname::text, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i"
        " JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'webhook_outbox'::regclass"
    )
    found = {}
    for name, bound in await cur.fetchall():
        texts = re.findall(r"'([^']+)'", bound)
        if len(texts) != 2:  # the legacy partition (MINVALUE) and the default one
            continue
        parsed = await conn.execute("SELECT %s::timestamptz, %s::timestamptz", texts)
        row = await parsed.fetchone()
        assert row is not None
        found[name] = (row[0].astimezone(UTC), row[1].astimezone(UTC))
    return found


async def test_partitions_made_across_a_dst_change_are_whole_utc_days(
    london: psycopg.AsyncConnection[Any],
) -> None:
    """A conversion a few days before the database's zone changes its clocks (the old table
    ends ahead, at ``cut``; the partitions from ``cut`` on are made by adding an interval):
    every partition is one day from 00:00 UTC and named by it, as documented, and the days
    follow each other without a gap or an overlap (which would stop the next maintenance,
    counting from UTC days, from making any partition)."""
    cur = await london.execute("SELECT now()")
    row = await cur.fetchone()
    assert row is not None
    now: dt.datetime = row[0]
    change = _next_change(ZoneInfo(LONDON), now + dt.timedelta(days=2))
    cut = change - dt.timedelta(days=1)
    assert await partitions.convert(london, interval_ms=DAY, first_partition_at=cut) is True
    ahead = math.ceil((change + dt.timedelta(days=3) - now) / dt.timedelta(days=1))
    made = await partitions.ensure_ahead(london, ahead=ahead)
    ranges = await _ranges(london)
    assert set(made) <= set(ranges)
    assert len(ranges) >= 4, ranges
    ordered = sorted(ranges.values())
    for name, (lower, upper) in ranges.items():
        assert (lower.hour, lower.minute) == (0, 0), (name, lower, upper)
        assert upper - lower == dt.timedelta(days=1), (name, lower, upper)
        assert name == f"webhook_outbox_p{lower:%Y%m%d}_0000", (name, lower)
    for (_, upper), (lower, _) in itertools.pairwise(ordered):
        assert upper == lower, ordered
    assert ordered[0][0] <= change < ordered[-1][1]


async def _attempt_at(conn: psycopg.AsyncConnection[Any], at: dt.datetime) -> int:
    cur = await conn.execute(
        "INSERT INTO webhook_outbox (stream_id, event_type, payload, processed, processed_at,"
        " outcome, status_code, duration_ms) VALUES ('tz', 'tz.test', '{}', true, %s,"
        " 'delivered', 200, 1.0) RETURNING id",
        (at,),
    )
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def test_tail_follows_attempts_across_the_clocks_going_forward(
    london: psycopg.AsyncConnection[Any],
) -> None:
    """An attempt recorded just after 01:00 UTC on the spring change (02:00:01 BST): the
    attempts after it are shown, not skipped for an hour (its time minus the look-back,
    01:59:59 on the wall clock, is an hour that day does not have)."""
    cursor = AttemptCursor(SPRING_2025 - dt.timedelta(minutes=1))
    first = await _attempt_at(london, SPRING_2025 + dt.timedelta(seconds=1))
    assert [a.id for a in await cursor.poll(london)] == [first]
    second = await _attempt_at(london, SPRING_2025 + dt.timedelta(seconds=30))
    assert [a.id for a in await cursor.poll(london)] == [second]


async def test_tail_shows_each_attempt_once_when_the_clocks_go_back(
    london: psycopg.AsyncConnection[Any],
) -> None:
    """Attempts on both sides of the autumn change (01:59:59 BST, then 01:00:01 GMT, which
    is later though it reads earlier): each is shown once, then the next one."""
    cursor = AttemptCursor(AUTUMN_2025 - dt.timedelta(minutes=1))
    before = await _attempt_at(london, AUTUMN_2025 - dt.timedelta(seconds=1))
    after = await _attempt_at(london, AUTUMN_2025 + dt.timedelta(seconds=1))
    assert [a.id for a in await cursor.poll(london)] == [before, after]
    assert await cursor.poll(london) == []
    later = await _attempt_at(london, AUTUMN_2025 + dt.timedelta(seconds=20))
    assert [a.id for a in await cursor.poll(london)] == [later]
    # The times shown keep the database's zone (with their offsets).
    cur = await london.execute("SELECT processed_at FROM webhook_outbox WHERE id = %s", (after,))
    row = await cur.fetchone()
    assert row is not None and row[0].isoformat() == "2025-10-26T01:00:01+00:00"


async def _claimed_at(conn: psycopg.AsyncConnection[Any], at: dt.datetime, row_id: int) -> Claimed:
    """A claimed row with its due time as the claim reads it (in the session's zone)."""
    cur = await conn.execute("SELECT %s::timestamptz", (at,))
    row = await cur.fetchone()
    assert row is not None
    return Claimed(row_id, "d", "tz.test", b"{}", 1, created_at=row[0])


async def test_a_claim_front_does_not_jump_a_gap_in_the_repeated_hour(
    london: psycopg.AsyncConnection[Any],
) -> None:
    """The claim loops' shared front (batch.ClaimFront) moves past a batch only when the
    claim that found it began at or before the front. Across the autumn change a claim
    that began at 01:10 GMT began after a front at 01:50 BST (00:50 UTC), though it reads
    earlier: the rows between were never looked at, so the front stays."""
    front = ClaimFront()
    at_front = await _claimed_at(london, AUTUMN_2025 - dt.timedelta(minutes=10), 1)
    front.advance(None, [at_front], 1)
    assert front.at is not None
    began = await _claimed_at(london, AUTUMN_2025 + dt.timedelta(minutes=10), 2)
    found = await _claimed_at(london, AUTUMN_2025 + dt.timedelta(minutes=55), 3)
    assert began.created_at is not None
    front.advance((began.created_at, 2), [found], 1)
    assert front.at == (AUTUMN_2025 - dt.timedelta(minutes=10), 1)


async def test_the_demos_failure_streak_is_measured_across_a_dst_change(
    london: psycopg.AsyncConnection[Any],
) -> None:
    """Failing since 01:59:59.5 BST, disabled at 01:00:00.5 GMT: one second, not minus an
    hour (the demo's check would fail) nor an hour more on the spring change."""
    cur = await london.execute(
        "SELECT %s::timestamptz, %s::timestamptz, %s::timestamptz, %s::timestamptz",
        (
            AUTUMN_2025 - dt.timedelta(seconds=0.5),
            AUTUMN_2025 + dt.timedelta(seconds=0.5),
            SPRING_2025 - dt.timedelta(seconds=0.5),
            SPRING_2025 + dt.timedelta(seconds=0.5),
        ),
    )
    row = await cur.fetchone()
    assert row is not None
    for since, disabled_at in ((row[0], row[1]), (row[2], row[3])):
        endpoint = SimpleNamespace(
            state="disabled",
            disabled_reason="failing",
            disabled_at=disabled_at,
            failing_since=since,
        )
        checks = auto_disabled(endpoint, disable_after_ms=1000, parked=1, owed=1, dead_letters=0)
        assert checks[0].ok, checks[0]
        assert "1.0 s after its first failure" in checks[0].detail, checks[0]


async def test_a_time_without_an_offset_is_utc_whatever_the_zones(
    london: psycopg.AsyncConnection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``recover --since``, the API's and the dashboard's ``since``/``until``: a time with no
    offset is UTC (documented), not the database's zone nor this host's ``TZ``."""
    monkeypatch.setenv("TZ", "America/Los_Angeles")
    naive = await endpoints.moment(london, "2025-07-01T12:00:00", "--since")
    assert naive == dt.datetime(2025, 7, 1, 12, 0, tzinfo=UTC)
    given = await endpoints.moment(london, "2025-07-01T12:00:00+13:45", "--since")
    assert given == dt.datetime(2025, 6, 30, 22, 15, tzinfo=UTC)
