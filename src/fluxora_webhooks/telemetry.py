"""Each attempt as an OpenTelemetry span (SPEC 18), with the ``otel`` extra.

:func:`from_env` reads the standard ``OTEL_*`` variables and returns an
:class:`AttemptTracer`, or None when tracing is not asked for. It is asked for when
``OTEL_TRACES_EXPORTER`` names an exporter (``otlp``, ``console``; ``none`` turns it off)
or an OTLP endpoint is set (``OTEL_EXPORTER_OTLP_ENDPOINT``,
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``); ``OTEL_SDK_DISABLED=true`` turns it off. Only then
is OpenTelemetry imported: installing the extra alone changes nothing, and a service
without it never imports it (the dispatcher then passes a valid stored context through,
see :func:`fluxora_webhooks.tracing.passthrough`).

The span of an attempt is a child of the context the producer stored with the event (a
fresh trace when there is none or it is not valid), of kind CLIENT, named
``webhook.attempt``. It carries the endpoint id, tenant, event type, attempt number,
delivery id, status code and outcome, and the consumer's host: never its URL (a path or a
query may hold a token) and never a secret. The request's ``traceparent`` (and
``tracestate``) name it, in the W3C format whatever ``OTEL_PROPAGATORS`` says: the header
is the contract with the consumer. Spans go out through a batch processor (its thread, not
the event loop) and are flushed when the service stops.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, MutableMapping
from contextvars import ContextVar
from functools import lru_cache
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from ._version import __version__
from .errors import ConfigError
from .outbox import Claimed
from .tracing import own_trace_id, passthrough, traceparent_header, tracestate_header

if TYPE_CHECKING:
    from .delivery import AttemptResult
    from .targets import Target

log = logging.getLogger("fluxora_webhooks.telemetry")

SPAN_NAME = "webhook.attempt"
EXPORTERS = ("otlp", "console", "none")
PROTOCOLS = ("http/protobuf", "grpc")
OTEL_EXTRA = "fluxora-webhooks[otel]"
# How long the service waits for the last spans to go out when it stops.
FLUSH_TIMEOUT_MS = 5_000


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() == "true"


def exporters_from_env(env: Mapping[str, str]) -> tuple[str, ...]:
    """The exporters the environment asks for (empty: no tracing). Raises
    :class:`ConfigError` naming the variable for a value that is not understood."""
    if _truthy(env.get("OTEL_SDK_DISABLED")):
        return ()
    raw = env.get("OTEL_TRACES_EXPORTER", "").strip()
    if not raw:
        endpoint = (
            env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
            or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
        )
        return ("otlp",) if endpoint else ()
    names = [name.strip().lower() for name in raw.split(",") if name.strip()]
    for name in names:
        if name not in EXPORTERS:
            raise ConfigError(
                "OTEL_TRACES_EXPORTER",
                f"{name[:40]!r} is not one of {', '.join(EXPORTERS)} (a comma-separated list"
                " of them, such as otlp,console, takes several)",
            )
    if "none" in names:
        return ()
    return tuple(dict.fromkeys(names))


def otlp_protocol(env: Mapping[str, str]) -> str:
    name = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
    raw = env.get(name, "").strip()
    if not raw:
        name = "OTEL_EXPORTER_OTLP_PROTOCOL"
        raw = env.get(name, "").strip()
    protocol = raw.lower() or "http/protobuf"
    if protocol not in PROTOCOLS:
        raise ConfigError(name, f"{raw[:40]!r} is not one of {', '.join(PROTOCOLS)}")
    return protocol


def check_otlp_endpoints(env: Mapping[str, str]) -> None:
    """The collector's URL, when given, is an http(s) URL with a host: the exporter took
    'not a url' at start-up and failed every export later. Its value is not shown."""
    from urllib.parse import urlsplit

    for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        raw = env.get(name, "").strip()
        if not raw:
            continue
        try:
            parts = urlsplit(raw)
            scheme, host, _ = parts.scheme, parts.hostname, parts.port
        except ValueError:  # a bracket left open, a port that is none
            scheme, host = "", None
        if scheme not in ("http", "https") or not host or any(c.isspace() for c in raw):
            raise ConfigError(
                name,
                "must be the collector's http:// or https:// URL, such as http://collector:4318",
            )


def check_env(env: Mapping[str, str]) -> None:
    """Refuse OTEL_* values that are not understood (without importing anything): the
    supervisor's check before it starts workers that would each refuse them."""
    if "otlp" in exporters_from_env(env):
        otlp_protocol(env)
        check_otlp_endpoints(env)


def from_env(env: Mapping[str, str]) -> AttemptTracer | None:
    """The tracer the ``OTEL_*`` variables ask for, or None (see the module's text). With
    the variables set but the extra missing, a warning and None: deliveries go on."""
    exporters = exporters_from_env(env)
    if not exporters:
        return None
    protocol = otlp_protocol(env) if "otlp" in exporters else ""
    if protocol:
        check_otlp_endpoints(env)
    try:
        return AttemptTracer(_provider(exporters, protocol))
    except ImportError as exc:
        log.warning(
            "OTEL_* variables ask for traces, but %s is not installed (%s missing): "
            "no spans are exported; trace headers are passed through",
            OTEL_EXTRA if protocol != "grpc" else "opentelemetry-exporter-otlp-proto-grpc",
            exc.name or "a module",
        )
        return None


def _provider(exporters: tuple[str, ...], protocol: str) -> Any:
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES win; ours names the service otherwise.
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: "fluxora-webhooks"}))
    # The sampler comes from OTEL_TRACES_SAMPLER (parent-based by default: a producer's
    # unsampled trace stays unsampled), the batch processor's limits from OTEL_BSP_*.
    # No exit hook of its own: the service flushes at its stop, bounded (AttemptTracer
    # .shutdown); the SDK's hook would wait at exit for an export to a collector that does
    # not answer (the exporter's own timeout, 10 s by default, per process).
    provider = TracerProvider(
        resource=resource, shutdown_on_exit=False, id_generator=_delivery_trace_ids()
    )
    for name in exporters:
        exporter: Any
        if name == "console":
            # One JSON object per line, on standard output.
            exporter = ConsoleSpanExporter(formatter=lambda span: span.to_json(indent=None) + "\n")
        elif protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[import-not-found,unused-ignore]
                OTLPSpanExporter,
            )

            exporter = OTLPSpanExporter()
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


@lru_cache(maxsize=4096)
def _host(url: str) -> str | None:
    try:
        return urlsplit(url).hostname
    except ValueError:
        return None


# The trace id a root span is to get (0: a random one): set around the start of an attempt
# span whose row has no producer's context (see _delivery_trace_ids).
_ROOT_TRACE_ID: ContextVar[int] = ContextVar("fluxora_root_trace_id", default=0)


def _delivery_trace_ids() -> Any:
    """The SDK's random ids, except a root span's trace id while :data:`_ROOT_TRACE_ID`
    names one: an event without a producer's context is then one trace per delivery (its
    id hashed, :func:`.tracing.own_trace_id`), every attempt of it in that trace, instead of a
    trace per attempt."""
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class DeliveryTraceIds(RandomIdGenerator):
        def generate_trace_id(self) -> int:
            return _ROOT_TRACE_ID.get() or super().generate_trace_id()

    return DeliveryTraceIds()


class AttemptTracer:
    """Opens one span per attempt and names it in the request's trace headers."""

    def __init__(self, provider: Any) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self._trace = trace
        self._tracer = provider.get_tracer("fluxora_webhooks", __version__)
        self._w3c = TraceContextTextMapPropagator()
        self._client = trace.SpanKind.CLIENT
        self._error = trace.StatusCode.ERROR

    def start(self, row: Claimed, target: Target, headers: MutableMapping[str, str]) -> Any:
        """Start the attempt's span, child of the row's stored context (a malformed one is
        ignored: a fresh trace), and put ``traceparent``/``tracestate`` naming it into
        ``headers``. Never raises: a tracing failure must not fail a delivery (the stored
        context is then passed through, and None returned)."""
        try:
            return self._start(row, target, headers)
        except Exception:
            log.exception("attempt span not started; the stored trace context is passed on")
            headers.update(passthrough(row.traceparent, row.tracestate))
            return None

    def _start(self, row: Claimed, target: Target, headers: MutableMapping[str, str]) -> Any:
        parent = None
        # The stored context as the request without a tracer would carry it, and as the API
        # names the delivery's trace (tracing.delivery_trace_id): one reading of the text a
        # plain-SQL producer wrote.
        stored = traceparent_header(row.traceparent)
        if stored is not None:
            carrier = {"traceparent": stored}
            state = tracestate_header(row.tracestate) if row.tracestate else None
            if state:
                carrier["tracestate"] = state
            parent = self._w3c.extract(carrier)
        attributes: dict[str, Any] = {
            "fluxora.endpoint.id": target.id,
            "fluxora.tenant": row.tenant,
            "fluxora.event.type": row.event_type,
            "fluxora.attempt": row.attempt,
            "fluxora.delivery.id": row.delivery_id,
            "http.request.method": "POST",
        }
        host = _host(target.url)
        if host:
            attributes["server.address"] = host
        rooted = (
            parent is None or not self._trace.get_current_span(parent).get_span_context().is_valid
        )
        # No producer's context (or a malformed one): the delivery's own trace, the same on
        # every attempt (a retry, a replay), so they are found together.
        token = _ROOT_TRACE_ID.set(own_trace_id(row.delivery_id)) if rooted else None
        try:
            span = self._tracer.start_span(
                SPAN_NAME, context=parent, kind=self._client, attributes=attributes
            )
        finally:
            if token is not None:
                _ROOT_TRACE_ID.reset(token)
        self._w3c.inject(headers, context=self._trace.set_span_in_context(span))
        return span

    def end(self, span: Any, result: AttemptResult | None, outcome: str) -> None:
        """End the span with the attempt's status code and outcome (``delivered``,
        ``retry``, ``dead_letter``; ``cancelled`` when the request was abandoned). The
        error's type is the status code, or the attempt's reason when there was no answer;
        never the consumer's text.
        Never raises."""
        try:
            self._end(span, result, outcome)
        except Exception:
            log.exception("attempt span not ended")

    def _end(self, span: Any, result: AttemptResult | None, outcome: str) -> None:
        try:
            span.set_attribute("fluxora.outcome", outcome)
            if result is not None and result.status is not None:
                span.set_attribute("http.response.status_code", result.status)
            if outcome != "delivered":
                # As OpenTelemetry's HTTP conventions name it: the status code when the
                # consumer answered (a 404 as a 500), else what failed (timeout, ...).
                if result is not None and result.status is not None:
                    kind = str(result.status)
                else:
                    kind = (result.reason if result is not None else "") or outcome
                span.set_attribute("error.type", kind)
                span.set_status(self._error, kind)
        finally:
            span.end()

    def shutdown(self) -> None:
        """Export what is left (bounded) and stop the exporters' threads."""
        try:
            self.provider.force_flush(FLUSH_TIMEOUT_MS)
        finally:
            self.provider.shutdown()
