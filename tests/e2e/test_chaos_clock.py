"""Clock trouble: due times come from the database's clock, never from a process's clock.

Dispatcher A, whose wall clock runs three hours *behind*, makes the first attempts and
schedules the retries; it stops, and dispatcher B, whose clock runs three hours *ahead*,
picks the retries up. Each retry is due when the database's clock says (the schedule's
delay, or the consumer's ``Retry-After``), and B delivers it then: not hours early, not
hours late. Each dispatcher's wall clock is shifted by injecting it
(:mod:`tests.support.skewed_run`); the database's clock is the real one.
"""

from __future__ import annotations

import time
from datetime import datetime
from email.utils import formatdate
from pathlib import Path

import pytest

from tests.support.chaos import (
    Behaviour,
    ChaosConsumer,
    Hit,
    account,
    clock_shift_env,
    enqueue_events,
    stop_processes,
    tracebacks,
)
from tests.support.dispatch import rows, scalar, wait_until
from tests.support.procs import dispatcher_env, start_dispatcher

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

HOURS_3 = 3 * 3600
SKEWED = "tests.support.skewed_run"
SCHEDULE_S = 4.0  # WEBHOOK_RETRY_SCHEDULE, plus up to 20 % jitter
RETRY_AFTER_S = 6  # as an HTTP date, on the consumer's clock


async def test_a_retry_scheduled_by_a_skewed_instance_is_due_by_the_database_clock(
    database_url: str, redis_url: str, redis_prefix: str, tmp_path: Path
) -> None:
    def choose(hit: Hit) -> Behaviour:
        return Behaviour.RETRY if hit.attempt == 1 else Behaviour.OK

    def retry_headers(hit: Hit) -> list[tuple[str, str]]:
        if hit.kind == "retry-after-date":
            return [("Retry-After", formatdate(time.time() + RETRY_AFTER_S, usegmt=True))]
        return []

    consumer = ChaosConsumer(choose)
    consumer.retry_headers = retry_headers
    await consumer.start()
    base = dispatcher_env(
        database_url, redis_url, consumer.url, redis_prefix,
        WEBHOOK_RETRY_SCHEDULE=f"{int(SCHEDULE_S * 1000)}ms", WEBHOOK_POLL_INTERVAL_MS="200",
        WEBHOOK_RETRY_RPS="1000",
    )  # fmt: skip
    env_a = base | clock_shift_env(-HOURS_3)
    env_b = base | clock_shift_env(+HOURS_3)
    kinds = ["schedule"] * 10 + ["retry-after-date"] * 10
    try:
        a = await start_dispatcher(env_a, tmp_path / "a.log", module=SKEWED)
        try:
            await enqueue_events(database_url, kinds)
            await consumer.wait_for(len(kinds))
            await wait_until(
                lambda: _retries_scheduled(database_url, len(kinds)), what="retries scheduled"
            )
        finally:
            assert await stop_processes([a]) == [0], a.log()
        b = await start_dispatcher(env_b, tmp_path / "b.log", module=SKEWED)
        try:
            try:
                await wait_until(
                    lambda: _delivered(database_url, len(kinds)), timeout=60, what="delivered"
                )
            except AssertionError:
                late = await rows(
                    database_url,
                    "SELECT payload->>'kind', EXTRACT(EPOCH FROM created_at - now())::int"
                    " FROM webhook_outbox WHERE NOT processed ORDER BY id",
                )
                raise AssertionError(f"retries not delivered; (kind, due in s): {late}") from None
        finally:
            assert await stop_processes([b]) == [0], b.log()
    finally:
        await consumer.stop()
    assert tracebacks(a.log()) == tracebacks(b.log()) == 0, (a.log(), b.log())

    # The clocks really were off, yet both instances signed with the database's time: a
    # consumer checking the timestamp against its own clock accepts every attempt.
    assert "wall clock shifted by -10800s" in a.log()
    assert "wall clock shifted by 10800s" in b.log()
    hits = consumer.by_delivery()
    for attempts in hits.values():
        for hit in attempts:
            assert abs(int(hit.headers["x-fluxora-timestamp"]) - hit.at) < 60
            assert hit.headers["webhook-timestamp"] == hit.headers["x-fluxora-timestamp"]

    # Due times are the database's now() at completion plus the delay, whatever A's clock.
    scheduled = await rows(
        database_url,
        "SELECT a1.delivery_id::text, a1.payload->>'kind',"
        "       EXTRACT(EPOCH FROM a2.created_at - a1.processed_at)::float8,"
        "       EXTRACT(EPOCH FROM a2.created_at)::float8"
        " FROM webhook_outbox a1 JOIN webhook_outbox a2"
        "   ON a2.delivery_id = a1.delivery_id AND a2.attempt = 2"
        " WHERE a1.attempt = 1 AND a1.outcome = 'retry'",
    )
    assert len(scheduled) == len(kinds)
    db_vs_consumer = await _clock_offset(database_url)
    for delivery_id, kind, delay_s, due_at in scheduled:
        if kind == "schedule":
            assert SCHEDULE_S - 0.01 <= delay_s <= SCHEDULE_S * 1.2 + 0.05, (kind, delay_s)
        else:
            # Retry-After lengthens the delay to the consumer's date (whole seconds).
            assert RETRY_AFTER_S - 1 <= delay_s <= RETRY_AFTER_S + 1.5, (kind, delay_s)
        # B sent the retry once it was due by the database's clock: not early, not late by
        # anything like the three hours its own clock is off.
        sent = hits[delivery_id][-1].at + db_vs_consumer
        assert hits[delivery_id][-1].attempt == 2
        assert due_at - 0.05 <= sent <= due_at + 30, (kind, due_at, sent)
    accounting = await account(database_url, consumer)
    assert accounting.ok and accounting.delivered == len(kinds), accounting


async def _retries_scheduled(database_url: str, n: int) -> bool:
    found = await scalar(
        database_url, "SELECT count(*) FROM webhook_outbox WHERE attempt = 2 AND NOT processed"
    )
    return int(found) == n


async def _delivered(database_url: str, n: int) -> bool:
    found = await scalar(
        database_url, "SELECT count(*) FROM webhook_outbox WHERE outcome = 'delivered'"
    )
    return int(found) == n


async def _clock_offset(database_url: str) -> float:
    """The database's clock minus this process's (both are this machine's: about 0)."""
    before = time.time()
    db_now: datetime = await scalar(database_url, "SELECT clock_timestamp()")
    after = time.time()
    return db_now.timestamp() - (before + after) / 2
