"""What an attempt tells the circuit breaker of its consumer (batch.breaker_signal): a 4xx
or 3xx is an answer (the consumer is up: a half-open breaker's probe closes it), a refusal
before any request or a hold at the egress proxy or the resolver says nothing of it."""

from __future__ import annotations

import pytest

from fluxora_webhooks.batch import breaker_signal
from fluxora_webhooks.delivery import EGRESS, AttemptResult
from fluxora_webhooks.gate import ANSWERED, Signal
from fluxora_webhooks.retry import Kind


@pytest.mark.parametrize(
    ("result", "signal"),
    [
        (AttemptResult(Kind.DELIVERED, status=204), True),
        (AttemptResult(Kind.RETRYABLE, status=503, reason="http_5xx"), False),
        (AttemptResult(Kind.RETRYABLE, error="connection refused"), False),
        (AttemptResult(Kind.RETRYABLE, error="proxy down", reason=EGRESS), None),
        (AttemptResult(Kind.PERMANENT, status=422, reason="http_4xx"), ANSWERED),
        (AttemptResult(Kind.PERMANENT, status=301, reason="http_3xx"), ANSWERED),
        (AttemptResult(Kind.PERMANENT, error="refused address", reason="endpoint_refused"), None),
    ],
    ids=["2xx", "5xx", "network", "egress held", "4xx", "3xx", "refused before sending"],
)
def test_what_an_attempt_says_of_its_consumer(result: AttemptResult, signal: Signal) -> None:
    assert breaker_signal(result) == signal
