"""Settings.from_env: every variable validated, the bad one named, nothing silent."""

from __future__ import annotations

import logging

import pytest

from fluxora_webhooks.errors import ConfigError
from fluxora_webhooks.settings import (
    EngineSettings,
    Settings,
    check_builtin_pairs,
    parse_duration_ms,
    parse_schedule,
)

GOOD = {
    "WEBHOOK_URL": "https://hooks.example.com/in",
    "WEBHOOK_SECRET": "a-long-enough-secret-for-hmac-0123",
}


def test_defaults_match_the_design_document() -> None:
    s = Settings.from_env(GOOD)
    assert s.poll_interval_ms == 10_000
    assert s.batch_size == 10
    assert s.retry_rps == 10
    assert s.circuit_breaker_threshold == 0
    assert s.circuit_breaker_reset_ms == 300_000
    assert s.max_attempts == 8
    assert s.retry_schedule_ms == (
        5_000,
        300_000,
        1_800_000,
        7_200_000,
        18_000_000,
        36_000_000,
        36_000_000,
    )
    assert s.timeout_ms == 15_000
    assert s.max_response_bytes == 65_536
    assert s.metrics_port == 9464
    assert s.database_url is None and s.redis_url is None


@pytest.mark.parametrize(
    ("variable", "value", "fragment"),
    [
        ("WEBHOOK_BATCH_SIZE", "0", "at least 1"),
        ("WEBHOOK_BATCH_SIZE", "1001", "at most 1000"),
        ("WEBHOOK_BATCH_SIZE", "ten", "not a whole number"),
        ("WEBHOOK_BATCH_SIZE", "1.5", "not a whole number"),
        ("WEBHOOK_POLL_INTERVAL_MS", "-5", "must be at least 1, got -5"),
        ("WEBHOOK_RETRY_RPS", "0", "at least 1"),
        ("WEBHOOK_CIRCUIT_BREAKER_THRESHOLD", "-1", "must be at least"),
        ("WEBHOOK_CIRCUIT_BREAKER_RESET_MS", "0", "at least 1"),
        ("WEBHOOK_MAX_ATTEMPTS", "0", "at least 1"),
        ("WEBHOOK_TIMEOUT_MS", "abc", "not a whole number"),
        ("WEBHOOK_MAX_RESPONSE_BYTES", "0", "at least 1"),
        ("WEBHOOK_METRICS_PORT", "70000", "at most 65535"),
        ("WEBHOOK_RETRY_SCHEDULE", "5s,,1m", "comma-separated"),
        ("WEBHOOK_RETRY_SCHEDULE", "5 seconds", "not a duration"),
        ("WEBHOOK_RETRY_SCHEDULE", "", "comma-separated"),
        ("WEBHOOK_SECRET", "", "must not be empty"),
        ("WEBHOOK_SECRET_PREVIOUS", "  ", "must not be empty"),
        ("WEBHOOK_URL", "ftp://example.com/x", "scheme"),
        ("WEBHOOK_URL", "http://example.com/x", "https is required"),
        ("WEBHOOK_URL", "https://user:pw@example.com/x", "credentials"),
        ("WEBHOOK_URL", "", "is required"),
        ("WEBHOOK_URL", "https://10.1.2.3/hook", "refused"),
        ("WEBHOOK_URL", "https://169.254.169.254/latest", "refused"),
        ("REDIS_URL", "localhost:6379", "redis://"),
        ("DATABASE_URL", "mysql://x", "postgresql://"),
        ("LOG_FORMAT", "xml", "text or json"),
        ("WEBHOOK_ALLOWED_NETWORKS", "10.0.0.0/8,nonsense", "not a CIDR"),
        ("WEBHOOK_RETENTION", "a week", "not a duration"),
        ("FLUXORA_REDIS_PREFIX", "tenant{a}:", "must not contain"),
        ("WEBHOOK_BATCH_SIZE", "", "empty"),
        ("WEBHOOK_POLL_INTERVAL_MS", "+5", "not a whole number"),
        ("WEBHOOK_POLL_INTERVAL_MS", "\u0661\u0660", "not a whole number"),  # Arabic-Indic 10
        ("WEBHOOK_POLL_INTERVAL_MS", "3600001", "at most"),
        ("WEBHOOK_TIMEOUT_MS", "3600001", "at most"),
        ("WEBHOOK_MAX_RESPONSE_BYTES", "99999999999", "at most"),
        ("WEBHOOK_CIRCUIT_BREAKER_RESET_MS", "999999999999", "at most"),
        ("WEBHOOK_RETRY_SCHEDULE", "5s,0s", "between 1ms and 7d"),
        ("WEBHOOK_RETRY_SCHEDULE", "3000000000h", "between 1ms and 7d"),
        ("WEBHOOK_SECRET", "whsec_not*base64!", "not valid base64"),
        ("REDIS_URL", "redis://127.0.0.1:abc/0", "port"),
        ("REDIS_URL", "redis://127.0.0.1:6379/zero", "must be a number"),
        ("REDIS_URL", "redis:///0", "no host"),
        ("WEBHOOK_METRICS_HOST", "not a host!", "not an address"),
    ],
)
def test_invalid_values_name_the_variable(variable: str, value: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        Settings.from_env({**GOOD, variable: value})
    assert info.value.variable == variable
    assert str(info.value).startswith(variable + ":")
    assert fragment in str(info.value)


def test_missing_secret_is_an_error() -> None:
    with pytest.raises(ConfigError, match="WEBHOOK_SECRET: is required"):
        Settings.from_env({"WEBHOOK_URL": GOOD["WEBHOOK_URL"]})


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({"WEBHOOK_SECRET": GOOD["WEBHOOK_SECRET"]}, "WEBHOOK_SECRET"),
        ({"WEBHOOK_SECRET_PREVIOUS": GOOD["WEBHOOK_SECRET"]}, "WEBHOOK_SECRET_PREVIOUS"),
        ({**GOOD, "WEBHOOK_OPERATOR_SECRET": GOOD["WEBHOOK_SECRET"]}, "WEBHOOK_OPERATOR_SECRET"),
    ],
)
def test_a_secret_without_its_url_is_an_error(env: dict[str, str], variable: str) -> None:
    """A misspelled WEBHOOK_URL (WEBHOOK_ULR=...) would otherwise start a run that removes
    the built-in endpoint and signs nothing, with no word said."""
    with pytest.raises(ConfigError) as info:
        check_builtin_pairs({"WEBHOOK_UlR": "https://hooks.example.com/in", **env})
    assert info.value.variable == variable
    assert "is set but WEBHOOK_" in str(info.value) and "_URL is not" in str(info.value)
    assert GOOD["WEBHOOK_SECRET"] not in str(info.value)


@pytest.mark.parametrize("value", ["", "  "])
def test_an_engine_url_set_but_empty_is_an_error(value: str) -> None:
    """Unset means the embedded engine; empty (a template whose value came out blank) is
    refused rather than read as unset: a run on a private engine never sees the outbox.
    An empty REDIS_URL is refused where Redis is used, not by a command that never uses
    it (migrate, from an environment shared with the service)."""
    with pytest.raises(ConfigError) as info:
        Settings.from_env({**GOOD, "DATABASE_URL": value})
    assert info.value.variable == "DATABASE_URL" and "set but empty" in str(info.value)
    assert Settings.from_env(GOOD).database_url is None  # unset: the embedded engine
    found = EngineSettings.from_env({"REDIS_URL": value})
    assert found.redis_url is None and found.redis_blank
    with pytest.raises(ConfigError) as info:
        found.check_redis()
    assert info.value.variable == "REDIS_URL" and "set but empty" in str(info.value)
    EngineSettings.from_env({}).check_redis()  # unset: the embedded Redis


def test_secret_never_appears_in_errors_or_repr() -> None:
    secret = "topsecret-value-that-must-not-leak-9876"
    s = Settings.from_env({**GOOD, "WEBHOOK_SECRET": secret, "WEBHOOK_SECRET_PREVIOUS": secret})
    assert secret not in repr(s)
    with pytest.raises(ConfigError) as info:
        Settings.from_env({**GOOD, "WEBHOOK_SECRET": secret, "WEBHOOK_BATCH_SIZE": "x"})
    assert secret not in str(info.value)


def test_short_secret_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        Settings.from_env({**GOOD, "WEBHOOK_SECRET": "short"})
    assert "WEBHOOK_SECRET is shorter than 24 bytes" in caplog.text
    assert "short" not in caplog.text.replace("shorter", "")


def test_loopback_http_is_allowed_and_threshold_zero_is_valid() -> None:
    s = Settings.from_env(
        {**GOOD, "WEBHOOK_URL": "http://127.0.0.1:8080/x", "WEBHOOK_CIRCUIT_BREAKER_THRESHOLD": "0"}
    )
    assert s.webhook_url == "http://127.0.0.1:8080/x"
    for host in ("localhost", "127.5.6.7", "[::1]"):
        Settings.from_env({**GOOD, "WEBHOOK_URL": f"http://{host}:9/x"})


def test_durations_and_schedules() -> None:
    assert parse_duration_ms("250ms", "X") == 250
    assert parse_duration_ms("5s", "X") == 5000
    assert parse_duration_ms("30m", "X") == 1_800_000
    assert parse_duration_ms("2h", "X") == 7_200_000
    assert parse_duration_ms("7d", "X") == 604_800_000
    assert parse_schedule("1s, 2m") == (1000, 120_000)


def test_whsec_secret_length_warning_looks_at_the_decoded_key(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import base64

    with caplog.at_level(logging.WARNING):
        Settings.from_env({**GOOD, "WEBHOOK_SECRET": "whsec_" + base64.b64encode(b"x").decode()})
    assert "shorter than 24 bytes" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        Settings.from_env(
            {**GOOD, "WEBHOOK_SECRET": "whsec_" + base64.b64encode(b"k" * 32).decode()}
        )
    assert "shorter" not in caplog.text


def test_a_dispatcher_built_in_code_checks_url_and_secret() -> None:
    import dataclasses

    from fluxora_webhooks.dispatcher import Dispatcher

    good = Settings.from_env(GOOD)
    with pytest.raises(ConfigError, match="https is required"):
        Dispatcher(dataclasses.replace(good, webhook_url="http://example.com/x"), conninfo="")
    with pytest.raises(ConfigError, match="secret"):
        Dispatcher(dataclasses.replace(good, secret=b""), conninfo="")


def test_a_misspelt_variable_is_warned_about_with_the_name_it_may_mean() -> None:
    """WEBHOOK_RETENTON=7d left retention off, without a word; the value is never shown."""
    from fluxora_webhooks.settings import unknown_variables

    env = {
        "WEBHOOK_RETENTON": "7d",
        "WEBHOOK_BATCHSIZE": "50",
        "WEBHOOK_SOMETHING_ELSE": "x",
        "FLUXORA_REDIS_PREFX": "secret-ish",
        "FLUXORA_TEST_DATABASE_URL": "postgresql://t",  # test tooling's prefix: not ours
        "WEBHOOK_SECRET_FILE": "/run/secrets/s",
        "WEBHOOK_RETENTION": "7d",
        "PATH": "/usr/bin",
    }
    assert unknown_variables(env) == [
        "FLUXORA_REDIS_PREFX is set but is no variable fluxora-webhooks reads"
        " (did you mean FLUXORA_REDIS_PREFIX?)",
        "WEBHOOK_BATCHSIZE is set but is no variable fluxora-webhooks reads"
        " (did you mean WEBHOOK_BATCH_SIZE?)",
        "WEBHOOK_RETENTON is set but is no variable fluxora-webhooks reads"
        " (did you mean WEBHOOK_RETENTION?)",
        "WEBHOOK_SOMETHING_ELSE is set but is no variable fluxora-webhooks reads",
    ]


def test_every_variable_the_source_reads_is_known() -> None:
    """The known set is every WEBHOOK_*/FLUXORA_* name the package's source spells out,
    so a new variable is not warned about as a typo."""
    import re
    from pathlib import Path

    import fluxora_webhooks
    from fluxora_webhooks.settings import KNOWN_VARIABLES, SECRET_FILE_VARIABLES

    root = Path(fluxora_webhooks.__file__).parent
    named = {
        m.group()
        for path in root.rglob("*.py")
        for m in re.finditer(r"\b(?:WEBHOOK|FLUXORA)_[A-Z0-9_]*[A-Z0-9]\b", path.read_text())
    }
    files = {f"{name}_FILE" for name in SECRET_FILE_VARIABLES}
    assert named - files <= KNOWN_VARIABLES
