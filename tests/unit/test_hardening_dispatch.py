"""Issue 18 (defects 2, 5, 10, 11, 13) where the dispatcher and the service wire them:
the connector's loopback rule, the secret check, what the logs mask, what is stored,
the breaker's transitions in the logs.
"""

from __future__ import annotations

import base64
import json
import logging
import ssl
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from fluxora_webhooks import logs
from fluxora_webhooks.clientcerts import ClientTls
from fluxora_webhooks.delivery import AttemptResult, scrub_stored, secret_texts
from fluxora_webhooks.dispatcher import (
    Dispatcher,
    _after_tls_began,
    _certificate_validity_said,
    _log_fields,
)
from fluxora_webhooks.errors import ConfigError
from fluxora_webhooks.httpclient import _origin, tls_failure
from fluxora_webhooks.outbox import Claimed, Outcome
from fluxora_webhooks.redis_gate import _count_transition
from fluxora_webhooks.retry import Decision, Kind
from fluxora_webhooks.service import Service
from fluxora_webhooks.signing import Signer
from fluxora_webhooks.targets import Target
from fluxora_webhooks.urlpolicy import loopback_rule
from tests.support.dispatch import SECRET, make_settings


@pytest.fixture
def no_sensitive() -> Iterator[None]:
    logs.clear_sensitive()
    yield
    logs.clear_sensitive()


# --- 2 and 6. The dispatcher's connector follows the rule of the normalised host --------


@pytest.mark.parametrize(
    ("url", "allow", "require"),
    [
        ("http://localhost:9/x", True, True),
        ("http://\uff4c\uff4f\uff43\uff41\uff4c\uff48\uff4f\uff53\uff54:9/x", True, True),
        ("http://127.0.0.1:9/x", True, True),
        ("https://localhost/x", True, False),
        ("https://hooks.example.com/x", False, False),
    ],
)
async def test_the_dispatcher_connects_by_the_rule_of_the_normalised_host(
    url: str, allow: bool, require: bool
) -> None:
    rule = loopback_rule(url)
    assert (rule.allow, rule.require) == (allow, require)
    dispatcher = Dispatcher(make_settings(url), conninfo="")
    target = dispatcher.targets.get("default")
    assert target is not None
    client = dispatcher._client_for(target)
    try:
        resolver = client.resolver
        assert (resolver.allow_loopback, resolver.require_loopback) == (allow, require)
    finally:
        await client.close()


def test_the_dispatcher_refuses_an_empty_key() -> None:
    with pytest.raises(ConfigError):
        Dispatcher(make_settings("https://hooks.example.com/", secret=b"whsec_"), conninfo="")


# --- 10. What the logs mask ---------------------------------------------------------------------


def test_engine_urls_register_their_passwords_not_their_parameters(no_sensitive: None) -> None:
    service = Service(
        make_settings("https://hooks.example.com/in?token=tok-value-123"),
        database_url="postgresql://app:db-pass-9876@db/app?sslmode=require"
        "&options=-c%20statement_timeout%3D5000&application_name=require",
        redis_url="redis://:redis-pass-5432@cache:6379/0?health_check_interval=30",
    )
    service._register_sensitive()
    text = (
        "sslmode require failed; options statement_timeout application_name health_check"
        " db-pass-9876 redis-pass-5432 tok-value-123 30"
    )
    assert logs.scrub(text) == (
        "sslmode require failed; options statement_timeout application_name health_check"
        " *** *** *** 30"
    )


def test_a_libpq_string_registers_its_password(no_sensitive: None) -> None:
    service = Service(
        make_settings("https://hooks.example.com/in"),
        database_url="host=db dbname=app password='pw with space' sslmode=require",
        redis_url=None,
    )
    service._register_sensitive()
    assert logs.scrub("pw with space, sslmode require") == "***, sslmode require"


# --- 13. What is stored is scrubbed as what is logged ------------------------------------------


def test_stored_text_masks_the_urls_secret_parts_and_the_signing_secret() -> None:
    url = "https://hooks.example.com/in/p4th-t0ken?token=query-t0ken&x=a%2Fb-long"
    secret = b"whsec_" + base64.b64encode(b"k" * 32)
    body = (
        f"you called {url} with token=query-t0ken, path /in/p4th-t0ken, a/b-long, "
        f"key {secret.decode()} or {secret.decode()[6:]}"
    )
    stored = scrub_stored(body, url, secret_texts(secret))
    assert stored is not None
    for leaked in ("query-t0ken", "p4th-t0ken", "a/b-long", "a%2Fb-long", secret.decode()[6:]):
        assert leaked not in stored, leaked
    assert "https://hooks.example.com" in stored
    assert scrub_stored(None, url) is None and scrub_stored("", url) == ""


@pytest.mark.parametrize(
    "url",
    [
        "https://hooks.example.com/in?token=Ab%2Fcd%2BQTokSecret66%3D%3D",
        "https://hooks.example.com/hooks/Ab%2Fcd%2BTokSecret55%3D%3D",
        "https://hooks.example.com/hooks/caf%c3%a9-Secret42",
    ],
    ids=["escaped query value", "escaped path", "lower-case escapes"],
)
def test_a_token_echoed_as_the_client_sent_it_is_stored_masked(url: str) -> None:
    """The HTTP client normalizes percent-escapes in its request line (``%3D`` goes out as
    ``=``, ``%c3`` as ``%C3``): a consumer echoing its request target echoes neither form
    the URL was written in, and that is masked too."""
    sent = _origin(url).target
    assert sent not in url  # the case: what goes out differs from what was written
    stored = scrub_stored(f"no route for POST {sent}", url)
    assert stored is not None and "Secret" not in stored, stored
    assert stored.startswith("no route for POST ") and "***" in stored, stored


def test_a_path_that_is_also_in_the_host_masks_the_path_not_the_host() -> None:
    """A URL's path is masked as a possible token; ``/hook`` is also in ``//hooks.``: the
    host (what is shown of a URL) is kept, in stored text and in the logs alike."""
    url = "https://hooks.tls.test:8443/hook"
    error = "connection failed to https://hooks.tls.test:8443: TLS certificate not accepted"
    assert scrub_stored(error, url) == error
    said = scrub_stored(f"POST /hook refused by {url}; see https://hooks.tls.test/hook", url)
    assert said == "POST *** refused by https://hooks.tls.test:8443; see https://hooks.tls.test***"
    logs.add_sensitive_url(url)
    try:
        assert logs.scrub(f"{error}; path /hook") == f"{error}; path ***"
    finally:
        logs.clear_sensitive()


# --- 11. Breaker transitions in the logs ---------------------------------------------------


def test_a_breaker_transition_is_logged_with_the_redacted_url(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="fluxora_webhooks.redis_gate"):
        _count_transition("https://hooks.example.com/in?token=abc-secret", "closed", "open")
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "https://hooks.example.com opened" in record.getMessage()
    assert "abc-secret" not in record.getMessage()


def test_a_breaker_transition_names_the_endpoints_of_its_url(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Endpoints on one host are told apart by their ids (those that send to the URL share
    its breaker); the URL's path and query are still never written."""
    url = "https://hooks.example.com/in/p4th?token=abc-secret"
    with caplog.at_level(logging.INFO, logger="fluxora_webhooks.redis_gate"):
        _count_transition(url, "closed", "open", lambda u: ["ep_b", "ep_a"] if u == url else [])
        _count_transition(url, "open", "half-open", lambda u: ["ep_a"])
        _count_transition(url, "half-open", "closed", lambda u: [f"ep_{i}" for i in range(7)])
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0].startswith(
        "circuit breaker for https://hooks.example.com (endpoints ep_a, ep_b) opened (from closed)"
    )
    assert messages[1].startswith("circuit breaker for https://hooks.example.com (endpoint ep_a)")
    assert messages[2].startswith(
        "circuit breaker for https://hooks.example.com (endpoints ep_0, ep_1, ep_2, ep_3, ep_4"
        " and 2 more) closed"
    )
    assert not any("p4th" in m or "abc-secret" in m for m in messages)


def test_a_delivery_record_carries_its_endpoint_tenant_and_reason() -> None:
    row = Claimed(1, "d-1", "stream.updated", b"{}", 3, tenant="acme", endpoint_id="ep_1")
    target = Target("ep_1", "acme", "https://hooks.example.com/in?token=t0ken", Signer(SECRET))
    result = AttemptResult(Kind.PERMANENT, status=404, duration_ms=12.345, reason="http_4xx")
    decision = Decision(Outcome.DEAD_LETTER, reason="http_4xx")
    record = logging.LogRecord(
        "fluxora_webhooks.dispatcher", logging.WARNING, "f", 1, "m", (), None
    )
    for name, value in _log_fields(row, target, result, decision).items():
        setattr(record, name, value)
    out = json.loads(logs.JsonFormatter().format(record))
    assert {k: out[k] for k in ("endpoint_id", "tenant", "reason", "status", "attempt")} == {
        "endpoint_id": "ep_1",
        "tenant": "acme",
        "reason": "http_4xx",
        "status": 404,
        "attempt": 3,
    }
    assert "t0ken" not in json.dumps(out) and "hooks.example.com" not in json.dumps(out)

    text = logs.TextFormatter().format(record)
    assert "endpoint_id=ep_1 tenant=acme reason=http_4xx" in text


def test_a_delivery_record_cuts_an_event_type_longer_than_enqueue_takes() -> None:
    """Plain SQL takes an event type of any length (enqueue() takes 200 characters): a
    record of a 20,000-character one holds its first 200 and its length."""
    long_type = "stream." + "x" * 19_993
    row = Claimed(1, "d-1", long_type, b"{}", 8, tenant="acme", endpoint_id="ep_1")
    target = Target("ep_1", "acme", "https://hooks.example.com/in", Signer(SECRET))
    result = AttemptResult(Kind.PERMANENT, status=413, duration_ms=1.0, reason="http_4xx")
    said = _log_fields(row, target, result, Decision(Outcome.DEAD_LETTER, reason="http_4xx"))
    assert said["event_type"] == f"{long_type[:200]}... (20000 characters)"
    fits = Claimed(1, "d-1", "s" * 200, b"{}", 1, tenant="acme", endpoint_id="ep_1")
    assert _log_fields(fits, target, result, Decision(Outcome.DELIVERED))["event_type"] == "s" * 200


# --- Same class as 4: what the logs carry to a terminal ------------------------------------


def _record(message: str, *args: object, **fields: object) -> logging.LogRecord:
    record = logging.LogRecord(
        "fluxora_webhooks.dispatcher", logging.INFO, "f", 1, message, args, None
    )
    for name, value in fields.items():
        setattr(record, name, value)
    return record


def test_text_logs_show_control_characters_as_escapes_and_stay_one_line() -> None:
    hostile = "HTTP 503 \x1b]8;;https://evil.example/\x1b\\\n2026-01-01 INFO forged\x9b\u202e"
    line = logs.TextFormatter().format(
        _record("delivery failed (%s)", hostile, event_type="stream.\x1b[2Jupdated")
    )
    assert "\n" not in line and "\x1b" not in line and "\x9b" not in line
    assert "\\x1b]8;;" in line and "\\x0a2026-01-01 INFO forged\\x9b\\u202e" in line
    assert "event_type=stream.\\x1b[2Jupdated" in line


def test_json_logs_escape_c1_controls_and_bidi_overrides_too() -> None:
    line = logs.JsonFormatter().format(_record("x \x9b \u202e \x1b"))
    assert "\x9b" not in line and "\u202e" not in line and "\x1b" not in line
    assert json.loads(line)["message"] == "x \x9b \u202e \x1b"  # still the same text


def test_a_tls_connection_closed_after_its_handshake_is_not_called_a_failed_handshake() -> None:
    """An SSLEOFError while a response is read (a keep-alive connection dropped mid-answer)
    is a closed connection; an alert read after the handshake (TLS 1.3's client
    certificate required) is still said as the handshake's refusal."""
    closed = ssl.SSLEOFError(8, "EOF occurred in violation of protocol")
    assert tls_failure(closed, handshake=False) == "TLS connection closed by the consumer"
    assert "TLS handshake failed" in tls_failure(closed)
    required = ssl.SSLError(1, "[SSL: TLSV13_ALERT_CERTIFICATE_REQUIRED] alert (_ssl.c:2580)")
    required.reason = "TLSV13_ALERT_CERTIFICATE_REQUIRED"
    said = tls_failure(required, handshake=False)
    assert "the consumer requires a client certificate" in said, said


@pytest.mark.parametrize(
    ("reason", "error", "said"),
    [
        ("connection_error", "connection failed to https://h.example/: Connection refused", False),
        ("connection_error", "connection failed to https://h.example/: unreachable", False),
        ("connection_error", "connection failed to https://h.example/: TLS handshake failed:"
         " sslv3 alert certificate expired", True),
        ("network_error", "https://h.example/: TLS connection closed by the consumer", True),
        ("network_error", "ConnectionResetError: [Errno 104] Connection reset by peer", True),
        ("timeout", "timeout", False),
    ],
    ids=["refused", "unreachable", "handshake", "closed-after", "reset", "timeout"],
)  # fmt: skip
def test_an_attempt_names_its_expired_client_certificate_only_where_tls_had_begun(
    reason: str, error: str, said: bool
) -> None:
    """A consumer refuses a client certificate in the TLS handshake or at the first read
    after it: a connection refused, an unreachable address or a timeout says nothing of
    the certificate and is not blamed on it."""
    tls = ClientTls("ab", ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), datetime(2020, 1, 1, tzinfo=UTC))
    result = AttemptResult(Kind.RETRYABLE, error=error, reason=reason)
    if _after_tls_began(result):
        result = _certificate_validity_said(result, tls)
    expected = error + (
        " (its client certificate expired on 2020-01-01T00:00:00+00:00)" if said else ""
    )
    assert result.error == expected
