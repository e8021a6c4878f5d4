"""The Prometheus series, all in one place.

Labels never carry a URL or a secret: a consumer is at most named by a short digest.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry(auto_describe=True)

DELIVERIES = Counter(
    "fluxora_webhook_deliveries",
    "Delivery attempts by outcome (delivered, retry, dead_letter, deferred).",
    ["outcome"],
    registry=REGISTRY,
)
ATTEMPT_DURATION = Histogram(
    "fluxora_webhook_attempt_duration_seconds",
    "Duration of one HTTP attempt, from request start to response read.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
    registry=REGISTRY,
)
ATTEMPTS_PER_DELIVERY = Histogram(
    "fluxora_webhook_attempts_per_delivery",
    "Attempt number at which a delivery ended (delivered or dead-lettered).",
    buckets=(1, 2, 3, 4, 5, 6, 8, 10, 15, 20),
    registry=REGISTRY,
)
IN_FLIGHT = Gauge(
    "fluxora_webhook_in_flight_requests",
    "HTTP attempts currently in flight in this process.",
    registry=REGISTRY,
)
DEAD_LETTERS = Counter(
    "fluxora_webhook_dead_letters",
    "Events moved to the dead-letter table, by reason.",
    ["reason"],
    registry=REGISTRY,
)
RATE_LIMIT_DEFERRALS = Counter(
    "fluxora_webhook_rate_limit_deferrals",
    "Retries deferred by the shared per-consumer rate limit.",
    registry=REGISTRY,
)
CIRCUIT_DEFERRALS = Counter(
    "fluxora_webhook_circuit_open_deferrals",
    "Attempts deferred because the consumer's circuit was open or half-open.",
    registry=REGISTRY,
)
REDIS_FAIL_OPEN = Counter(
    "fluxora_webhook_redis_fail_open",
    "Gate checks that proceeded without Redis because it was unavailable.",
    ["component"],
    registry=REGISTRY,
)
BREAKER_TRANSITIONS = Counter(
    "fluxora_webhook_circuit_breaker_transitions",
    "Circuit breaker state transitions.",
    ["from_state", "to_state"],
    registry=REGISTRY,
)
OUTBOX_PENDING = Gauge(
    "fluxora_webhook_outbox_pending",
    "Unprocessed outbox rows (due now or later).",
    registry=REGISTRY,
)
OUTBOX_OLDEST_DUE_AGE = Gauge(
    "fluxora_webhook_outbox_oldest_due_age_seconds",
    "Age of the oldest due, unprocessed outbox row (0 when none is due).",
    registry=REGISTRY,
)
DEAD_LETTER_ROWS = Gauge(
    "fluxora_webhook_dead_letter_rows",
    "Dead letters waiting (not replayed or purged).",
    registry=REGISTRY,
)
CLAIM_ERRORS = Counter(
    "fluxora_webhook_claim_errors",
    "Claim-loop iterations that failed on a database error (retried with backoff).",
    registry=REGISTRY,
)
