"""The trace headers sent for a stored context (never a malformed one), and what the OTEL_*
variables ask for."""

from __future__ import annotations

import pytest

from fluxora_webhooks.errors import ConfigError
from fluxora_webhooks.telemetry import exporters_from_env, otlp_protocol
from fluxora_webhooks.tracing import passthrough, traceparent_header, tracestate_header

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
VALID = f"00-{TRACE}-{PARENT}-01"


@pytest.mark.parametrize(
    "value",
    [
        VALID,
        f"00-{TRACE}-{PARENT}-00",
        f" {VALID}\t",
    ],
)
def test_valid_traceparents_go_out_as_version_00(value: str) -> None:
    assert traceparent_header(value) == value.strip()


def test_a_later_version_is_sent_as_version_00_without_its_extra_fields() -> None:
    assert traceparent_header(f"cc-{TRACE}-{PARENT}-01-what-comes-next") == VALID


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        "garbage",
        f"ff-{TRACE}-{PARENT}-01",  # version ff is invalid
        f"00-{'0' * 32}-{PARENT}-01",  # all-zero trace id
        f"00-{TRACE}-{'0' * 16}-01",  # all-zero parent id
        f"00-{TRACE.upper()}-{PARENT}-01",  # uppercase hex
        f"00-{TRACE}-{PARENT}-01-extra",  # version 00 has exactly four fields
        f"00-{TRACE[:-1]}-{PARENT}-01",
        f"00-{TRACE}-{PARENT}-1",
        f"00-{TRACE}-{PARENT}-01\r\nx-injected: 1",
        f"cc-{TRACE}-{PARENT}-01-\x00",
        "00-" + "a" * 600,
        12345,
    ],
)
def test_malformed_traceparents_send_nothing(value: object) -> None:
    assert traceparent_header(value) is None
    assert passthrough(value, "vendor=1") == {}  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("vendor=abc", "vendor=abc"),
        ("a=1, b=2", "a=1,b=2"),
        ("tenant@system=x,rojo=00f067aa0ba902b7", "tenant@system=x,rojo=00f067aa0ba902b7"),
        ("", None),
        ("novalue", None),
        ("Upper=1", None),  # keys are lowercase
        ("a=1,a=2", None),  # a key at most once
        ("a=1\r\nx: y", None),
        ("a=" + "x" * 600, None),
        (",".join(f"k{i}=v" for i in range(33)), None),  # at most 32 members
    ],
)
def test_tracestate_is_sent_only_when_valid(value: str, expected: str | None) -> None:
    assert tracestate_header(value) == expected


def test_passthrough_sends_the_stored_context() -> None:
    assert passthrough(VALID, None) == {"traceparent": VALID}
    assert passthrough(VALID, "vendor=abc") == {"traceparent": VALID, "tracestate": "vendor=abc"}
    assert passthrough(VALID, "not valid") == {"traceparent": VALID}


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, ()),
        ({"OTEL_TRACES_EXPORTER": "console"}, ("console",)),
        ({"OTEL_TRACES_EXPORTER": "otlp, console"}, ("otlp", "console")),
        ({"OTEL_TRACES_EXPORTER": "none"}, ()),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, ("otlp",)),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, ("otlp",)),
        ({"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "true"}, ()),
    ],
)
def test_tracing_is_on_only_when_the_environment_asks(
    env: dict[str, str], expected: tuple[str, ...]
) -> None:
    assert exporters_from_env(env) == expected


def test_unknown_exporter_or_protocol_is_an_error_naming_the_variable() -> None:
    with pytest.raises(ConfigError, match="OTEL_TRACES_EXPORTER"):
        exporters_from_env({"OTEL_TRACES_EXPORTER": "zipkin"})
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_PROTOCOL"):
        otlp_protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
    assert otlp_protocol({}) == "http/protobuf"
    assert otlp_protocol({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}) == "grpc"


def test_a_failing_tracer_never_fails_the_attempt(caplog: pytest.LogCaptureFixture) -> None:
    from fluxora_webhooks.outbox import Claimed
    from fluxora_webhooks.signing import Signer
    from fluxora_webhooks.targets import Target
    from fluxora_webhooks.telemetry import AttemptTracer

    class Broken:
        def get_tracer(self, *args: object) -> Broken:
            return self

        def start_span(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError("exporter exploded")

    tracer = AttemptTracer(Broken())
    row = Claimed(1, "d-1", "stream.updated", b"{}", 1, traceparent=VALID, tracestate="a=1")
    target = Target("ep_1", "acme", "https://x.example/h?token=t", Signer(b"k" * 32))
    headers: dict[str, str] = {}
    assert tracer.start(row, target, headers) is None
    assert headers == {"traceparent": VALID, "tracestate": "a=1"}  # passed through
    tracer.end(object(), None, "cancelled")  # a span that cannot be ended: logged only
    assert "attempt span not started" in caplog.text and "attempt span not ended" in caplog.text


@pytest.mark.parametrize(
    ("result", "outcome", "error_type"),
    [
        (("permanent", 404, "http_4xx"), "dead_letter", "404"),
        (("retryable", 503, ""), "retry", "503"),
        (("retryable", None, "timeout"), "retry", "timeout"),
        (("permanent", None, "endpoint_refused"), "dead_letter", "endpoint_refused"),
        (None, "cancelled", "cancelled"),
        (("delivered", 200, ""), "delivered", None),
    ],
)
def test_a_failed_attempts_error_type_is_its_status_code_or_what_failed(
    result: tuple[str, int | None, str] | None, outcome: str, error_type: str | None
) -> None:
    """OpenTelemetry's HTTP conventions: the status code as text when the consumer
    answered (a 4xx as a 5xx), else a short name of what failed; none when delivered."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from fluxora_webhooks.delivery import AttemptResult
    from fluxora_webhooks.outbox import Claimed
    from fluxora_webhooks.retry import Kind
    from fluxora_webhooks.signing import Signer
    from fluxora_webhooks.targets import Target
    from fluxora_webhooks.telemetry import AttemptTracer

    exported = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exported))
    tracer = AttemptTracer(provider)
    row = Claimed(1, "d-1", "stream.updated", b"{}", 1)
    target = Target("ep_1", "acme", "https://x.example/h", Signer(b"k" * 32))
    span = tracer.start(row, target, {})
    attempt = None
    if result is not None:
        kind, status, reason = result
        attempt = AttemptResult(Kind(kind), status=status, reason=reason)
    tracer.end(span, attempt, outcome)
    (finished,) = exported.get_finished_spans()
    assert (finished.attributes or {}).get("error.type") == error_type
    provider.shutdown()


@pytest.mark.parametrize(
    "stored", [VALID, f" {VALID}\n", f"01-{TRACE}-{PARENT}-01-\x01", "garbage", None]
)
def test_an_attempts_span_is_in_the_trace_the_api_names(stored: str | None) -> None:
    """The dispatcher reads a stored traceparent as the API does (delivery_trace_id): the
    span's trace is the producer's when the text is valid, else the delivery's own."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from fluxora_webhooks.outbox import Claimed
    from fluxora_webhooks.signing import Signer
    from fluxora_webhooks.targets import Target
    from fluxora_webhooks.telemetry import AttemptTracer, _delivery_trace_ids
    from fluxora_webhooks.tracing import delivery_trace_id

    exported = InMemorySpanExporter()
    provider = TracerProvider(id_generator=_delivery_trace_ids())  # as the service's
    provider.add_span_processor(SimpleSpanProcessor(exported))
    tracer = AttemptTracer(provider)
    row = Claimed(1, "d-7", "stream.updated", b"{}", 1, traceparent=stored, tracestate="bad =")
    headers: dict[str, str] = {}
    tracer.end(
        tracer.start(
            row, Target("ep_1", "acme", "https://x.example/h", Signer(b"k" * 32)), headers
        ),
        None,
        "cancelled",
    )
    (span,) = exported.get_finished_spans()
    assert f"{span.context.trace_id:032x}" == delivery_trace_id("d-7", stored)
    assert "tracestate" not in headers  # an invalid stored one is not passed on
    provider.shutdown()


@pytest.mark.parametrize(
    "value",
    [
        "not a url",
        "ftp://collector:4318",
        "http://",
        "collector:4318",
        "http://c:99999",
        "http://[::1",
    ],
)
def test_a_collector_url_that_is_none_is_refused_at_start_up(value: str) -> None:
    """It was taken, and every export failed later ('Failed to parse: Host ...')."""
    from fluxora_webhooks.telemetry import check_env

    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        with pytest.raises(ConfigError, match=f"{name}: must be the collector's http"):
            check_env({name: value})
    check_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    check_env({"OTEL_EXPORTER_OTLP_ENDPOINT": value, "OTEL_TRACES_EXPORTER": "console"})
