"""The Prometheus series, all in one place.

Labels never carry a URL or a secret. The per-endpoint series name endpoints by id, and
only the worst few of the last reading plus one ``_other`` (:class:`EndpointCollector`), so
their number stays bounded however many endpoints there are. Counters are exposed with the
``_total`` suffix (``fluxora_webhook_deliveries`` is scraped as
``fluxora_webhook_deliveries_total``).

Who writes what:

- the dispatcher: deliveries, attempt duration, attempts per delivery, in-flight requests,
  dead letters, claim errors;
- the Redis gate: rate-limit and circuit-open deferrals, Redis fail-opens, breaker
  transitions;
- the service, in the background (``service.py``): the backlog gauges (outbox pending and
  due, oldest due age, dead letters waiting), read every few seconds from the partial
  indexes with capped counts, the worst endpoints' health, the breaker state read from
  Redis, and the retention counters;
- the supervisor (``supervisor.py``): workers wanted and dispatching, worker restarts, and
  (instead of a worker) the worst endpoints' health, read at a scrape.

Every label value that can occur is created at import, so each series exists (at 0) from
the first scrape and ``rate()``/``increase()`` see the first event.

Under the supervisor (``WEBHOOK_WORKERS`` above 1, :mod:`.supervisor`) each worker process
writes its values to files that the supervisor's ``/metrics`` merges
(prometheus-client's multiprocess mode): counters and histograms are summed over every
worker, those that died included; in-flight requests are summed over the live workers;
the readings that one worker takes for all (backlog, breaker state) are shown as last set
(``mostrecent``). In one process the modes change nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import GaugeMetricFamily, Metric

from ._version import __version__

REGISTRY = CollectorRegistry(auto_describe=True)
# A worker under the supervisor writes its values to files the supervisor merges
# (prometheus-client's multiprocess mode, chosen by PROMETHEUS_MULTIPROC_DIR at its
# import). The supervisor's own series must have no sample in a worker, or they would come
# back from every worker's files beside the supervisor's. Whether this process is such a
# worker is what the supervisor says with WORKER_VARIABLE, not PROMETHEUS_MULTIPROC_DIR
# alone: that one is often inherited from an environment made for gunicorn apps (the
# command line clears it for its own process: see cli.main).
WORKER_VARIABLE = "FLUXORA_WORKER"
_IN_WORKER = os.environ.get(WORKER_VARIABLE) == "1"
IN_WORKER = _IN_WORKER

# Every Outcome (outbox.Outcome): attempts' outcomes, and what a row got without one.
OUTCOMES = (
    "delivered",
    "retry",
    "dead_letter",
    "deferred",
    "parked",
    "leased",
    "routed",
    "unrouted",
)
DEAD_LETTER_REASONS = (
    "attempts_exhausted",
    "http_4xx",
    "http_3xx",
    "endpoint_refused",
    "endpoint_removed",
    "invalid_request",
    "internal_error",
)
DISABLED_REASONS = ("manual", "gone", "failing")
REDIS_COMPONENTS = ("gate", "ratelimit", "breaker")
BREAKER_STATES = ("closed", "open", "half-open")
BREAKER_TRANSITION_PAIRS = (
    ("closed", "open"),
    ("open", "half-open"),
    ("half-open", "closed"),
    ("half-open", "open"),
)
RETENTION_TABLES = ("outbox", "dead_letter")
RETENTION_RESULTS = ("ok", "skipped", "error")

BUILD_INFO = Gauge(
    "fluxora_webhook_build_info",
    "Always 1; the version of fluxora-webhooks in a label.",
    ["version"],
    multiprocess_mode="max",
    registry=REGISTRY,
)

# -- the dispatcher ----------------------------------------------------------------------

DELIVERIES = Counter(
    "fluxora_webhook_deliveries",
    "Claimed rows by outcome: attempts (delivered, retry, dead_letter) and rows handled "
    "without one (deferred, parked: endpoint disabled, leased: a request that outlived its "
    "batch, routed: an event row fanned out with no default endpoint, unrouted: an event "
    "row that matched no endpoint).",
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
    multiprocess_mode="livesum",
    registry=REGISTRY,
)
DEAD_LETTERS = Counter(
    "fluxora_webhook_dead_letters",
    "Events moved to the dead-letter table, by reason.",
    ["reason"],
    registry=REGISTRY,
)
CLAIM_ERRORS = Counter(
    "fluxora_webhook_claim_errors",
    "Claim-loop iterations that failed on a database error (retried with backoff).",
    registry=REGISTRY,
)

DETACHED = Counter(
    "fluxora_webhook_detached_requests",
    "Requests that outlived their batch (slow endpoints) and were recorded under a lease.",
    registry=REGISTRY,
)
EGRESS_FAILURES = Counter(
    "fluxora_webhook_egress_failures",
    "Attempts the egress proxy (WEBHOOK_PROXY_URL) failed before any consumer was asked:"
    " it could not be reached, did not answer in time, gave no usable answer or refused this"
    " service's credentials."
    " Their rows were deferred with the attempt unused, counted against no endpoint.",
    registry=REGISTRY,
)
RESOLVER_FAILURES = Counter(
    "fluxora_webhook_resolver_failures",
    "Attempts held because this service's DNS lookups fail (names that resolved before get"
    " no answer): no consumer was asked. Their rows were deferred with the attempt unused,"
    " counted against no endpoint.",
    registry=REGISTRY,
)
SHARE_DEFERRED = Counter(
    "fluxora_webhook_share_deferred_requests",
    "Requests to slow endpoints not sent because the requests detached from their batches"
    " held their share of WEBHOOK_MAX_CONNECTIONS; their rows were deferred.",
    registry=REGISTRY,
)
ENDPOINTS_DISABLED = Counter(
    "fluxora_webhook_endpoints_disabled",
    "Endpoints disabled by this process, by reason (gone: HTTP 410, failing: failing for "
    "longer than WEBHOOK_DISABLE_AFTER).",
    ["reason"],
    registry=REGISTRY,
)

# -- the Redis gate ----------------------------------------------------------------------

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
    "Circuit breaker state transitions made by this process.",
    ["from_state", "to_state"],
    registry=REGISTRY,
)

# -- the service's background readings ---------------------------------------------------

OUTBOX_PENDING = Gauge(
    "fluxora_webhook_outbox_pending",
    "Unprocessed outbox rows (due now or later). Counted exactly up to a cap; above it, "
    "PostgreSQL's estimate (see fluxora_webhook_outbox_pending_estimated).",
    multiprocess_mode="mostrecent",
    registry=REGISTRY,
)
OUTBOX_DUE = Gauge(
    "fluxora_webhook_outbox_due",
    "Unprocessed outbox rows due now. Counted up to a cap (a lower bound above it).",
    multiprocess_mode="mostrecent",
    registry=REGISTRY,
)
OUTBOX_PENDING_ESTIMATED = Gauge(
    "fluxora_webhook_outbox_pending_estimated",
    "1 when the backlog exceeded the counting cap and the pending/due gauges are estimates.",
    multiprocess_mode="mostrecent",
    registry=REGISTRY,
)
OUTBOX_OLDEST_DUE_AGE = Gauge(
    "fluxora_webhook_outbox_oldest_due_age_seconds",
    "Age of the oldest due, unprocessed outbox row (0 when none is due).",
    multiprocess_mode="mostrecent",
    registry=REGISTRY,
)
DEAD_LETTER_ROWS = Gauge(
    "fluxora_webhook_dead_letter_rows",
    "Dead letters waiting (not replayed or purged). Counted up to a cap.",
    multiprocess_mode="mostrecent",
    registry=REGISTRY,
)
OUTBOX_DEFAULT_PARTITION_ROWS = Gauge(
    "fluxora_webhook_outbox_default_partition_rows",
    "Rows in a partitioned outbox's default partition: rows no partition covered when they "
    "were written (no dispatcher made partitions ahead meanwhile). It should be 0; the "
    "service moves them into their partition when it makes it. 0 on an ordinary outbox; "
    "counted up to a cap.",
    multiprocess_mode="mostrecent",
    registry=REGISTRY,
)
BACKLOG_REFRESHED = Gauge(
    "fluxora_webhook_backlog_refreshed_timestamp_seconds",
    "Unix time of the last successful reading of the backlog gauges.",
    multiprocess_mode="mostrecent",
    registry=REGISTRY,
)
BACKLOG_REFRESH_ERRORS = Counter(
    "fluxora_webhook_backlog_refresh_errors",
    "Readings of the backlog gauges that failed (the gauges keep their last values).",
    registry=REGISTRY,
)
BREAKER_STATE = Gauge(
    "fluxora_webhook_circuit_breaker_state",
    "The consumer's shared circuit breaker state as last read from Redis: 1 for the "
    "current state, 0 for the others (all 0 when Redis cannot be read; while the breaker "
    "is off or before its first reading, no samples, or all 0: a single process shows its "
    "three series from the start, a run with workers none).",
    ["state"],
    multiprocess_mode="mostrecent",
    registry=REGISTRY,
)

# -- endpoints (bounded cardinality) ------------------------------------------------------

# The endpoint label of the series that sums every endpoint not named (ids never start
# with an underscore: see endpoints.new_id).
OTHER_ENDPOINTS = "_other"
ENDPOINT_STATES = ("enabled", "disabled", "failing")


@dataclass(frozen=True, slots=True)
class EndpointReading:
    """One endpoint as the per-endpoint series show it."""

    id: str
    tenant: str
    pending: int
    failing_for_s: float  # 0: no failure streak
    disabled: bool


class EndpointCollector:
    """The per-endpoint series, from the last reading of the endpoints' health (the
    service's background reading, or the supervisor's at a scrape).

    Cardinality is bounded by construction: only the worst endpoints of the last reading
    are named (``ops.METRIC_ENDPOINTS``: disabled by the dispatcher, failing longest, largest
    backlog), and the backlog of all the others is one series, ``endpoint="_other"``. The
    series are made at each scrape from that reading, so an endpoint that is no longer
    among the worst leaves no stale series behind (a Gauge per endpoint would keep every
    label it was ever given, and in the supervisor's multiprocess files forever).
    Nothing is exposed before the first reading.
    """

    def __init__(self) -> None:
        self._worst: Sequence[EndpointReading] | None = None
        self._totals = (0, 0, 0, 0)

    def update(
        self,
        worst: Sequence[EndpointReading],
        *,
        total_pending: int,
        endpoints: int,
        disabled: int,
        failing: int,
    ) -> None:
        self._worst = tuple(worst)
        self._totals = (total_pending, endpoints, disabled, failing)

    def describe(self) -> list[Metric]:
        return []  # made at each scrape

    def collect(self) -> Iterator[Metric]:
        worst = self._worst
        if worst is None:
            return
        total_pending, endpoints, disabled, failing = self._totals
        pending = GaugeMetricFamily(
            "fluxora_webhook_endpoint_pending",
            "Pending deliveries of the worst endpoints (disabled by the dispatcher, failing "
            "longest, largest backlog; counted up to a cap each), and of all the others as "
            'endpoint="_other".',
            labels=["endpoint", "tenant"],
        )
        streak = GaugeMetricFamily(
            "fluxora_webhook_endpoint_failing_seconds",
            "How long the named endpoints have been failing (0: their last attempt succeeded).",
            labels=["endpoint", "tenant"],
        )
        off = GaugeMetricFamily(
            "fluxora_webhook_endpoint_disabled",
            "1 when the named endpoint is disabled (its deliveries are parked).",
            labels=["endpoint", "tenant"],
        )
        named = 0
        for e in worst:
            labels = [e.id, e.tenant]
            pending.add_metric(labels, e.pending)
            streak.add_metric(labels, e.failing_for_s)
            off.add_metric(labels, 1 if e.disabled else 0)
            named += e.pending
        pending.add_metric([OTHER_ENDPOINTS, ""], max(0, total_pending - named))
        states = GaugeMetricFamily(
            "fluxora_webhook_endpoints",
            "Endpoints by state: enabled, disabled, and failing (enabled, with a failure streak).",
            labels=["state"],
        )
        states.add_metric(["enabled"], endpoints - disabled)
        states.add_metric(["disabled"], disabled)
        states.add_metric(["failing"], failing)
        yield from (pending, streak, off, states)


# In the process that serves /metrics (one service, or the supervisor: see supervisor.py).
ENDPOINTS_COLLECTOR = EndpointCollector()
if not _IN_WORKER:
    REGISTRY.register(ENDPOINTS_COLLECTOR)

# -- retention ---------------------------------------------------------------------------

RETENTION_DELETED = Counter(
    "fluxora_webhook_retention_deleted_rows",
    "Rows deleted by the retention task, by table (outbox, dead_letter).",
    ["table"],
    registry=REGISTRY,
)
RETENTION_RUNS = Counter(
    "fluxora_webhook_retention_runs",
    "Retention runs by result (ok; skipped: another instance was pruning; error).",
    ["result"],
    registry=REGISTRY,
)


# -- the management API (api/, where it runs: `api`, or `run` with WEBHOOK_API_PORT) ------
# Labelled by the route's template (/api/v1/endpoints/{endpoint_id}), never by a path: an
# id, a tenant or a query never becomes a label. No label value is created at import: a
# worker never serves the API, and a series it created would come back from its files.

API_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
# Not fluxora_webhook_build_info: that one says a dispatcher is scraped (the
# FluxoraWebhooksAbsent alert, the Grafana dashboard's instances), and an API process is
# none. Set by `fluxora-webhooks api` on its metrics port.
API_BUILD_INFO = Gauge(
    "fluxora_api_build_info",
    "Always 1, labelled with the version of the management API process (`api`).",
    ["version"],
    registry=None,
)

API_REQUESTS = Counter(
    "fluxora_api_requests",
    "Requests the management API answered, by method, route template (none: answered before "
    "routing, or no route takes it) and status; 429 is the request rate limit "
    "(WEBHOOK_API_RATE_LIMIT).",
    ["method", "route", "status"],
    registry=REGISTRY,
)
API_REQUEST_DURATION = Histogram(
    "fluxora_api_request_duration_seconds",
    "Time from a request's arrival to the end of its answer, by method and route template.",
    ["method", "route"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
    registry=REGISTRY,
)

# -- the supervisor (WEBHOOK_WORKERS above 1) -----------------------------------------

WORKERS = Gauge(
    "fluxora_webhook_workers",
    "Dispatcher processes of this run, by state: wanted (WEBHOOK_WORKERS) and dispatching "
    "(running their claim loops). A single-process run is one of each.",
    ["state"],
    registry=REGISTRY,
)
WORKER_RESTARTS = Counter(
    "fluxora_webhook_worker_restarts",
    "Worker processes that died and were replaced, by cause: exit (ended with a status), "
    "signal (killed by one), or unresponsive (killed by the supervisor after it had not "
    "answered for a minute).",
    ["cause"],
    registry=REGISTRY,
)
WORKER_STATES = ("wanted", "dispatching")
RESTART_CAUSES = ("exit", "signal", "unresponsive")


def without_created_series() -> None:
    """No ``*_created`` series beside the counters in this process's /metrics (the text
    format shows each as a gauge family of its own, a timestamp nobody asked for). Called
    by ``run`` for its own process: an application that embeds the library keeps its
    own choice."""
    disable_created_metrics()  # type: ignore[no-untyped-call]


def set_breaker_state(state: str | None) -> None:
    """Set the one-hot breaker state gauge; ``None`` clears it (state unknown)."""
    for name in BREAKER_STATES:
        BREAKER_STATE.labels(state=name).set(1 if name == state else 0)


def _initialise() -> None:
    BUILD_INFO.labels(version=__version__).set(1)
    for outcome in OUTCOMES:
        DELIVERIES.labels(outcome=outcome)
    for reason in DISABLED_REASONS:
        ENDPOINTS_DISABLED.labels(reason=reason)
    for reason in DEAD_LETTER_REASONS:
        DEAD_LETTERS.labels(reason=reason)
    for component in REDIS_COMPONENTS:
        REDIS_FAIL_OPEN.labels(component=component)
    for from_state, to_state in BREAKER_TRANSITION_PAIRS:
        BREAKER_TRANSITIONS.labels(from_state=from_state, to_state=to_state)
    for name in BREAKER_STATES:
        # Created, not set: a set value carries its time, and a worker that (re)starts must
        # not outdate the reading another worker took (multiprocess_mode="mostrecent").
        BREAKER_STATE.labels(state=name)
    for table in RETENTION_TABLES:
        RETENTION_DELETED.labels(table=table)
    for result in RETENTION_RESULTS:
        RETENTION_RUNS.labels(result=result)
    if not _IN_WORKER:
        for state in WORKER_STATES:
            WORKERS.labels(state=state).set(1)
        for cause in RESTART_CAUSES:
            WORKER_RESTARTS.labels(cause=cause)


_initialise()
