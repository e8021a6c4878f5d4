"""The retry schedule, jitter, Retry-After, and the exhaustion decision (a fake clock)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import pytest

from fluxora_webhooks.delivery import classify_status
from fluxora_webhooks.retry import RETRY_AFTER_CAP_MS, Kind, RetryPolicy, parse_retry_after

DAY_SCHEDULE = (5_000, 300_000, 1_800_000, 7_200_000, 18_000_000, 36_000_000, 36_000_000)


def test_default_schedule_is_about_a_day_and_repeats_its_last_entry() -> None:
    policy = RetryPolicy(max_attempts=8, schedule_ms=DAY_SCHEDULE, jitter=lambda: 0.0)
    delays = [policy.delay_ms(a) for a in range(1, 8)]
    assert delays == list(DAY_SCHEDULE)
    assert 20 * 3_600_000 < sum(delays) < 30 * 3_600_000
    short = RetryPolicy(max_attempts=10, schedule_ms=(1000, 2000), jitter=lambda: 0.0)
    assert [short.delay_ms(a) for a in range(1, 6)] == [1000, 2000, 2000, 2000, 2000]


def test_jitter_is_at_most_twenty_percent_and_never_shortens() -> None:
    assert RetryPolicy(8, (10_000,), jitter=lambda: 0.0).delay_ms(1) == 10_000
    assert RetryPolicy(8, (10_000,), jitter=lambda: 0.999999).delay_ms(1) == 11_999
    import random

    rng = random.Random(7)
    policy = RetryPolicy(8, (10_000,), jitter=rng.random)
    samples = [policy.delay_ms(1) for _ in range(1000)]
    assert min(samples) >= 10_000 and max(samples) < 12_000
    assert len(set(samples)) > 100  # it really spreads retries


def test_retry_after_lengthens_never_shortens_and_is_capped() -> None:
    policy = RetryPolicy(8, (60_000,), jitter=lambda: 0.0)
    assert policy.delay_ms(1, retry_after_ms=1_000) == 60_000
    assert policy.delay_ms(1, retry_after_ms=120_000) == 120_000
    assert policy.delay_ms(1, retry_after_ms=10 * 24 * 3_600_000) == RETRY_AFTER_CAP_MS


def test_retry_after_forms() -> None:
    now = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)
    later = format_datetime(now + timedelta(seconds=90), usegmt=True)
    assert parse_retry_after("120", now.timestamp()) == 120_000
    assert parse_retry_after(later, now.timestamp()) == 90_000
    assert (
        parse_retry_after(format_datetime(now - timedelta(hours=1), usegmt=True), now.timestamp())
        == 0
    )
    assert parse_retry_after("soon", now.timestamp()) is None
    assert parse_retry_after(None, now.timestamp()) is None
    assert parse_retry_after("-5", now.timestamp()) is None
    assert parse_retry_after("999999999999", now.timestamp()) == RETRY_AFTER_CAP_MS


def test_exhaustion() -> None:
    policy = RetryPolicy(max_attempts=3, schedule_ms=(1,))
    assert not policy.exhausted(1) and not policy.exhausted(2) and policy.exhausted(3)
    assert RetryPolicy(max_attempts=1, schedule_ms=(1,)).exhausted(1)


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (200, Kind.DELIVERED),
        (201, Kind.DELIVERED),
        (204, Kind.DELIVERED),
        (299, Kind.DELIVERED),
        (408, Kind.RETRYABLE),
        (425, Kind.RETRYABLE),
        (429, Kind.RETRYABLE),
        (500, Kind.RETRYABLE),
        (502, Kind.RETRYABLE),
        (503, Kind.RETRYABLE),
        (599, Kind.RETRYABLE),
        (400, Kind.PERMANENT),
        (401, Kind.PERMANENT),
        (403, Kind.PERMANENT),
        (404, Kind.PERMANENT),
        (410, Kind.PERMANENT),
        (422, Kind.PERMANENT),
        (301, Kind.PERMANENT),
        (302, Kind.PERMANENT),
        (307, Kind.PERMANENT),
        (308, Kind.PERMANENT),
    ],
)
def test_status_classification(status: int, kind: Kind) -> None:
    assert classify_status(status) is kind
