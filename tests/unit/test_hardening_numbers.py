"""Issue 18 (defects 1, 3, 5, 7, 8): untrusted text turned into numbers, durations and
keys strictly and within bounds. Property tests close each class: whatever text
arrives, a ``Retry-After`` is a bounded delay or None, a duration or a whole-number
setting is a value or a ConfigError naming its variable; never another exception.
"""

from __future__ import annotations

import base64
import operator
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fluxora_webhooks.demo import consumer as demo_consumer
from fluxora_webhooks.errors import ConfigError
from fluxora_webhooks.retention import MAX_OLDER_THAN_MS
from fluxora_webhooks.retry import RETRY_AFTER_CAP_MS, parse_http_date, parse_retry_after
from fluxora_webhooks.settings import (
    _INTEGERS,
    MAX_DURATION_MS,
    EngineSettings,
    Settings,
    parse_duration_ms,
    parse_schedule,
)
from fluxora_webhooks.signing import Signer, verify

GOOD = {
    "WEBHOOK_URL": "https://hooks.example.com/in",
    "WEBHOOK_SECRET": "a-long-enough-secret-for-hmac-0123",
}
NOW = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC).timestamp()
PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HUGE = "9" * 5000  # int() refuses more than 4,300 digits


# Digits of any length, up to well past the 4,300 int() accepts.
long_numbers = st.builds(
    lambda digit, count, pad: pad + digit * count + pad,
    st.sampled_from("0123456789"),
    st.integers(min_value=1, max_value=6000),
    st.sampled_from(["", " ", "0"]),
)


# --- 1. Retry-After ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        "\u00b2",
        "\u2460",
        "\u0661\u0662\u0660",
        "\uff11\uff12\uff10",
        "12\u00b2",
        "+5",
        "-5",
        "1_0",
        "5.5",
        "",
        " ",
    ],
)
def test_a_retry_after_that_is_not_ascii_delta_seconds_or_a_date_is_ignored(value: str) -> None:
    assert parse_retry_after(value, NOW) is None


def test_retry_after_of_any_length_is_capped_not_an_error() -> None:
    assert parse_retry_after(HUGE, NOW) == RETRY_AFTER_CAP_MS
    assert parse_retry_after("0" * 5000 + "7", NOW) == 7000  # leading zeros are no value
    assert parse_retry_after("86401", NOW) == RETRY_AFTER_CAP_MS
    assert parse_retry_after(" 120\t", NOW) == 120_000
    far = format_datetime(datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC), usegmt=True)
    assert parse_retry_after(far, NOW) == RETRY_AFTER_CAP_MS


def test_date_parsing_never_raises() -> None:
    for text in ("Mon, 31 Feb 2020 00:00:00 GMT", f"Mon, 1 Jan {HUGE} 00:00:00 GMT", "x" * 10_000):
        assert parse_http_date(text) is None
    later = format_datetime(datetime.fromtimestamp(NOW, UTC) + timedelta(seconds=30), usegmt=True)
    assert parse_http_date(later) == NOW + 30


@PROPERTY
@given(st.one_of(st.text(max_size=80), long_numbers))
@example("\u00b2")
@example("9" * 4301)
@example("Wed, 21 Oct 2015 07:28:00 -9999")
@example("Fri, 31 Dec 9999 23:59:59 -2359")
@example("Mon, 01 Jan 0001 00:00:00 +2359")
def test_any_retry_after_is_a_bounded_delay_or_none(value: str) -> None:
    result = parse_retry_after(value, NOW)
    assert result is None or 0 <= result <= RETRY_AFTER_CAP_MS
    when = parse_http_date(value)
    assert when is None or isinstance(when, float)


# --- 3. Retention and durations ------------------------------------------------------------


@pytest.mark.parametrize("value", ["0", "0d", "0s", "0ms", "00h", "off", "OFF", ""])
def test_a_zero_retention_is_off(value: str) -> None:
    assert Settings.from_env({**GOOD, "WEBHOOK_RETENTION": value}).retention_ms is None


@pytest.mark.parametrize("value", ["99999999999999d", "36501d", HUGE + "d", "876001h"])
def test_a_retention_beyond_a_hundred_years_is_refused_naming_the_variable(value: str) -> None:
    with pytest.raises(ConfigError) as caught:
        Settings.from_env({**GOOD, "WEBHOOK_RETENTION": value})
    assert caught.value.variable == "WEBHOOK_RETENTION"
    assert "at most 36500d" in caught.value.problem
    assert len(str(caught.value)) < 200  # a huge value is not echoed whole


def test_the_duration_bound_is_the_library_bound() -> None:
    assert MAX_DURATION_MS == MAX_OLDER_THAN_MS
    assert parse_duration_ms("36500d", "X") == MAX_DURATION_MS
    assert Settings.from_env({**GOOD, "WEBHOOK_RETENTION": "7d"}).retention_ms == 604_800_000


# --- 5. An empty key once decoded --------------------------------------------------------------


@pytest.mark.parametrize("variable", ["WEBHOOK_SECRET", "WEBHOOK_SECRET_PREVIOUS"])
def test_whsec_with_nothing_after_it_is_an_error(variable: str) -> None:
    with pytest.raises(ConfigError) as caught:
        Settings.from_env({**GOOD, variable: "whsec_"})
    assert caught.value.variable == variable
    assert "empty key" in caught.value.problem


def test_no_signer_or_verifier_takes_an_empty_key() -> None:
    with pytest.raises(ValueError):
        Signer(b"whsec_")
    with pytest.raises(ValueError):
        Signer(b"k" * 32, b"whsec_")
    with pytest.raises(ValueError):
        verify(b"{}", {}, "whsec_")
    good = "whsec_" + base64.b64encode(b"k" * 32).decode()
    Signer(good.encode())


# --- 7 and 8. Whole numbers of any length, bounds, one DATABASE_URL check ----------------------


@pytest.mark.parametrize("variable", sorted(v for v, _, _ in _INTEGERS.values()))
@pytest.mark.parametrize("value", [HUGE, "99999999999999999999", "\u00b2", "1e3"])
def test_every_integer_setting_refuses_any_number_naming_itself(variable: str, value: str) -> None:
    with pytest.raises(ConfigError) as caught:
        Settings.from_env({**GOOD, variable: value})
    assert caught.value.variable == variable
    assert len(str(caught.value)) < 200


def test_the_schedule_refuses_any_length() -> None:
    with pytest.raises(ConfigError, match="between 1ms and 7d"):
        parse_schedule(f"5s,{HUGE}ms")
    with pytest.raises(ConfigError, match="between 1ms and 7d"):
        parse_schedule("5s,99999999999999999999999d")


@pytest.mark.parametrize(
    ("variable", "limit"),
    [("WEBHOOK_RETRY_RPS", 100_000), ("WEBHOOK_CIRCUIT_BREAKER_THRESHOLD", 100_000)],
)
def test_rate_and_threshold_have_upper_bounds(variable: str, limit: int) -> None:
    parsed = Settings.from_env({**GOOD, variable: str(limit)})
    assert getattr(parsed, variable.removeprefix("WEBHOOK_").lower()) == limit
    with pytest.raises(ConfigError, match=f"at most {limit}"):
        Settings.from_env({**GOOD, variable: str(limit + 1)})


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://%zz",
        "postgresql://[::1/db",
        "a=b",
        "postgresql://h/db?foo=bar",
        "postgresql://u@h:notaport/db",
        "host=x port=abc",
        "postgresql://h:99999/db",
        "host=x password secret-token",
        # Read by libpq only when it connects: refused before, not by every pool connection.
        "postgresql://h/db?target_session_attrs=read-write&connect_timeout=5s",
        "postgresql://h/db?connect_timeout=abc",
        "postgresql://h/db?sslmode=bogus",
        "host=x target_session_attrs=readwrite",
        # libpq refuses these counts at every connection, which start-up would wait on.
        "postgresql://postgres@h1:5442,h2:5443,h3:5444/fx?port=1,2",
        "host=a,b,c port=1,2",
        "host=a,b hostaddr=127.0.0.1",
    ],
)
def test_a_garbage_database_url_is_a_config_error_for_every_command(url: str) -> None:
    with pytest.raises(ConfigError) as caught:
        EngineSettings.from_env({"DATABASE_URL": url})
    assert caught.value.variable == "DATABASE_URL"
    assert "secret-token" not in str(caught.value)


def test_good_database_urls_pass() -> None:
    for url in (
        "postgresql://u:p@h1:5432,h2:5433/db?target_session_attrs=read-write&sslmode=require",
        "host=/tmp dbname=app",
        "postgresql:///app?host=/var/run/postgresql",
        "postgresql://h/db?connect_timeout=10&target_session_attrs=prefer-standby",
        "host=x connect_timeout=0 sslmode=verify-full",
        "postgresql://h1,h2:5433/db",
        "host=a,b port=5432",
        "host=a,b hostaddr=127.0.0.1,127.0.0.2 port=1,2",
    ):
        assert EngineSettings.from_env({"DATABASE_URL": url}).database_url == url


@PROPERTY
@given(
    st.one_of(
        st.text(max_size=40),
        long_numbers,
        st.sampled_from(["\u00b2", "\u0661", "1_0", "0x10", "-1", "+1"]),
    ),
    st.sampled_from(sorted(v for v, _, _ in _INTEGERS.values())),
)
@example("9" * 4301, "WEBHOOK_BATCH_SIZE")
def test_any_integer_setting_is_a_value_or_a_refusal_naming_it(text: str, variable: str) -> None:
    try:
        Settings.from_env({**GOOD, variable: text})
    except ConfigError as exc:
        assert exc.variable == variable


@PROPERTY
@given(
    st.one_of(
        st.text(max_size=40),
        st.builds(operator.add, long_numbers, st.sampled_from(["ms", "s", "m", "h", "d"])),
    ),
    st.sampled_from(["WEBHOOK_RETENTION", "WEBHOOK_RETRY_SCHEDULE"]),
)
@example("0d", "WEBHOOK_RETENTION")
@example("9" * 4301 + "d", "WEBHOOK_RETENTION")
@example("99999999999999d", "WEBHOOK_RETENTION")
def test_any_duration_is_a_value_or_a_refusal_naming_it(text: str, variable: str) -> None:
    try:
        s = Settings.from_env({**GOOD, variable: text})
    except ConfigError as exc:
        assert exc.variable == variable
        return
    if variable == "WEBHOOK_RETENTION":
        assert s.retention_ms is None or 1 <= s.retention_ms <= MAX_DURATION_MS
    else:
        assert all(1 <= d <= 7 * 86_400_000 for d in s.retry_schedule_ms)


def test_the_demo_consumer_reads_the_attempt_without_raising() -> None:
    assert demo_consumer._attempt({"x-fluxora-attempt": "\u00b2"}) == 1
    assert demo_consumer._attempt({"x-fluxora-attempt": HUGE}) == 1
    assert demo_consumer._attempt({"x-fluxora-attempt": "3"}) == 3


# --- 9. Engine URLs with control characters ------------------------------------------------


def test_a_redis_url_with_a_control_character_is_refused() -> None:
    for url in ("redis://127.0.0.1\t:6379/0", "redis://127.0.0.1:6379/0\n/1", "redis://[::1"):
        with pytest.raises(ConfigError) as caught:
            EngineSettings.from_env({"REDIS_URL": url})
        assert caught.value.variable == "REDIS_URL"
