"""The producer's trace context, carried from ``enqueue`` to the consumer (SPEC 18).

OpenTelemetry is an extra (``fluxora-webhooks[otel]``). Without it nothing here imports it,
and nothing changes. A producer that uses OpenTelemetry has imported it already, so
:func:`current_context` looks only when ``opentelemetry.trace`` is loaded: a producer that
does not trace pays one dictionary lookup per event.

The stored context is the producer's text (a plain-SQL producer may write anything into
``webhook_outbox.traceparent``), so it is checked before it goes out as a header:
:func:`traceparent_header` and :func:`tracestate_header` return the W3C form or None, never
a malformed value. The dispatcher without a tracer passes a valid stored context through
as it is (:func:`passthrough`); with one (:mod:`.telemetry`) each attempt is a span, child
of that context, and the headers name the span.
"""

from __future__ import annotations

import hashlib
import re
import sys

# version-trace_id-parent_id-flags (W3C Trace Context, level 1), lowercase hex only.
_TRACEPARENT = re.compile(
    r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-[^\x00-\x20\x7f-\xff]*)?",
    re.ASCII,
)
_VERSION_00 = re.compile(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}", re.ASCII)
_ZERO_TRACE = "0" * 32
_ZERO_PARENT = "0" * 16
# A tracestate list member: key=value, keys simple or multi-tenant (tenant@system).
_TRACESTATE_MEMBER = re.compile(
    r"(?:[a-z][_0-9a-z\-*/]{0,255}|[a-z0-9][_0-9a-z\-*/]{0,240}@[a-z][_0-9a-z\-*/]{0,13})"
    r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]",
    re.ASCII,
)
MAX_TRACESTATE_CHARS = 512
MAX_TRACESTATE_MEMBERS = 32
# The longest stored traceparent looked at (a later version may append fields).
_MAX_TRACEPARENT_CHARS = 512


def current_context() -> tuple[str | None, str | None]:
    """(traceparent, tracestate) of the caller's current span, or (None, None). Always in
    the W3C form the column and the request carry, whatever propagators the producer's
    OTEL_PROPAGATORS installs globally (b3 or baggage alone stored nothing)."""
    if "opentelemetry.trace" not in sys.modules:
        return None, None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return carrier.get("traceparent"), carrier.get("tracestate") or None


def traceparent_header(value: object) -> str | None:
    """The ``traceparent`` to send for a stored value: version 00 of it when it is a valid
    W3C traceparent (a later version's extra fields are dropped, as the W3C text says a
    reader of version 00 does), else None. Never raises."""
    if not isinstance(value, str) or len(value) > _MAX_TRACEPARENT_CHARS:
        return None
    if len(value) == 55 and value[:3] == "00-" and _VERSION_00.fullmatch(value):
        # The common case, checked in one match: a version 00 header as written.
        if value[3:35] == _ZERO_TRACE or value[36:52] == _ZERO_PARENT:
            return None
        return value
    match = _TRACEPARENT.fullmatch(value.strip(" \t"))
    if match is None:
        return None
    version, trace_id, parent_id, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    if trace_id == _ZERO_TRACE or parent_id == _ZERO_PARENT:
        return None
    return f"00-{trace_id}-{parent_id}-{flags}"


def tracestate_header(value: object) -> str | None:
    """The ``tracestate`` to send for a stored value: the list as it is when every member
    is valid (at most 32, at most 512 characters), else None (the W3C text says an invalid
    tracestate is discarded whole). Never raises."""
    if not isinstance(value, str) or not value or len(value) > MAX_TRACESTATE_CHARS:
        return None
    members = [m.strip(" \t") for m in value.split(",")]
    members = [m for m in members if m]
    if not members or len(members) > MAX_TRACESTATE_MEMBERS:
        return None
    if not all(_TRACESTATE_MEMBER.fullmatch(m) for m in members):
        return None
    keys = [m.split("=", 1)[0] for m in members]
    if len(set(keys)) != len(keys):
        return None
    return ",".join(members)


def passthrough(traceparent: str | None, tracestate: str | None) -> dict[str, str]:
    """The trace headers of an attempt made without a tracer: the stored context when it
    is valid (the consumer's span is then a child of the producer's), else none."""
    parent = traceparent_header(traceparent)
    if parent is None:
        return {}
    state = tracestate_header(tracestate) if tracestate else None
    return {"traceparent": parent, "tracestate": state} if state else {"traceparent": parent}


def own_trace_id(delivery_id: str) -> int:
    """The trace of a delivery whose event has no valid producer's context: its id hashed
    to 128 bits (never 0, which is no trace id), every attempt of it in that trace. Not the
    UUID's own bits: a version 4 UUID fixes bits of its low half, which a ratio sampler
    (OTEL_TRACES_SAMPLER=traceidratio) reads, and sampled none of them at rates up to a
    half."""
    digest = hashlib.blake2b(delivery_id.encode(), digest_size=16).digest()
    return int.from_bytes(digest, "big") or 1


def delivery_trace_id(delivery_id: str, traceparent: object) -> str:
    """The trace id (32 hex digits) of a delivery's attempt spans when the dispatcher
    traces: the producer's stored context's when it is valid, else the delivery's own."""
    parent = traceparent_header(traceparent)
    if parent is not None:
        return parent[3:35]
    return f"{own_trace_id(delivery_id):032x}"
