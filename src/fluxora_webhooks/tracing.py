"""The producer's trace context, carried from ``enqueue`` to the consumer (SPEC 18).

OpenTelemetry is an extra (``fluxora-webhooks[otel]``). Without it nothing here imports it,
and nothing changes. A producer that uses OpenTelemetry has imported it already, so
:func:`current_context` looks only when ``opentelemetry.trace`` is loaded: a producer that
does not trace pays one dictionary lookup per event.
"""

from __future__ import annotations

import sys


def current_context() -> tuple[str | None, str | None]:
    """(traceparent, tracestate) of the caller's current span, or (None, None)."""
    if "opentelemetry.trace" not in sys.modules:
        return None, None
    from opentelemetry import propagate

    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier.get("traceparent"), carrier.get("tracestate") or None
