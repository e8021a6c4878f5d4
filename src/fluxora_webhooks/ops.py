"""Operational readings shared by the service's gauges, ``status`` and the demo: the outbox
backlog, recent outcomes and a consumer's breaker and rate-limit window.

Read-only, and cheap however large the tables are: counts come from the partial indexes and
stop at a cap; Redis being unreachable is part of the answer, never an error.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row

from . import metrics, partitions
from .delivery import HELD_WORDS
from .endpoints import OPERATOR_TENANT
from .logs import scrub
from .migrations import check_schema
from .outbox import Outcome
from .pgtypes import open_session
from .queries import query
from .redis_connect import client_for
from .redis_gate import RATE_WINDOW_MS, rate_limit_key, read_breaker_state
from .urlpolicy import redacted

# The service's gauges count at most this many rows per reading (see read_backlog).
BACKLOG_COUNT_CAP = 100_000
# The status command may count further than the service's gauges do: it runs once.
STATUS_COUNT_CAP = 1_000_000
REDIS_TIMEOUT_S = 1.0
# Pending deliveries counted per endpoint, at most (see read_endpoint_health).
ENDPOINT_COUNT_CAP = 10_000
# The endpoints the per-endpoint metrics name (the worst); the others are summed as one.
METRIC_ENDPOINTS = 10
# The endpoints status shows by default.
STATUS_ENDPOINTS = 10
# The outcomes an attempt record can hold, in the order status shows them.
RECORDED_OUTCOMES = (Outcome.DELIVERED, Outcome.RETRY, Outcome.DEAD_LETTER)


@dataclass(frozen=True, slots=True)
class Backlog:
    """The outbox backlog at one moment (see :func:`read_backlog`)."""

    pending: int
    due: int
    oldest_due_age_s: float  # 0 when nothing is due
    next_due_in_s: float | None  # the earliest row due later; None when there is none
    dead_letters: int
    capped: bool  # a count reached the cap: ``pending`` is an estimate, ``due`` a lower bound
    cap: int
    # A partitioned outbox's rows in its default partition (up to the cap); None otherwise.
    default_partition_rows: int | None = None


async def read_backlog(conn: psycopg.AsyncConnection[Any], cap: int = BACKLOG_COUNT_CAP) -> Backlog:
    """Read the backlog cheaply, however large the table.

    Everything comes from the partial indexes (``webhook_outbox_due_idx``,
    ``webhook_dead_letter_dead_idx``); counts stop at ``cap`` rows. When the pending count
    reaches the cap, ``pending`` is the larger of the cap and PostgreSQL's own estimate of
    the partial index's size (``pg_class.reltuples``, kept current by autovacuum), and
    ``capped`` is set; ``due`` and ``dead_letters`` are then lower bounds.
    """
    cur = await conn.execute(query("backlog"), {"cap": cap})
    row = await cur.fetchone()
    assert row is not None
    pending, due, oldest, next_due, estimate, dead = row
    capped = int(pending) >= cap or int(due) >= cap or int(dead) >= cap
    if int(pending) >= cap:
        pending = max(cap, int(estimate or 0))
    return Backlog(
        default_partition_rows=await partitions.default_rows(conn, cap),
        pending=int(pending),
        due=int(due),
        oldest_due_age_s=max(0.0, float(oldest or 0.0)),
        next_due_in_s=None if next_due is None else max(0.0, float(next_due)),
        dead_letters=int(dead),
        capped=capped,
        cap=cap,
    )


async def read_egress_held(conn: psycopg.AsyncConnection[Any], cap: int) -> int:
    """How many deliveries (up to ``cap``) wait because the egress proxy or the DNS
    resolver failed: their row says one of :data:`~.delivery.HELD_WORDS` until they are
    sent."""
    cur = await conn.execute(
        query("egress_held"), {"held": HELD_WORDS, "scoped": False, "tenant": "", "cap": cap}
    )
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


def set_backlog_gauges(backlog: Backlog) -> None:
    metrics.OUTBOX_PENDING.set(backlog.pending)
    metrics.OUTBOX_DUE.set(backlog.due)
    metrics.OUTBOX_PENDING_ESTIMATED.set(1 if backlog.capped else 0)
    metrics.OUTBOX_OLDEST_DUE_AGE.set(backlog.oldest_due_age_s)
    metrics.DEAD_LETTER_ROWS.set(backlog.dead_letters)
    metrics.OUTBOX_DEFAULT_PARTITION_ROWS.set(backlog.default_partition_rows or 0)
    metrics.BACKLOG_REFRESHED.set(time.time())


@dataclass(frozen=True, slots=True)
class EndpointState:
    """One endpoint's health (see :func:`read_endpoint_health`)."""

    id: str
    tenant: str
    state: str
    disabled_reason: str | None
    disabled_at: datetime | None
    failing_since: datetime | None
    failing_for_s: float | None
    pending: int  # counted up to the cap
    parked: int
    capped: bool

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "tenant": None if self.tenant == OPERATOR_TENANT else self.tenant,
            "state": self.state,
            "disabled_reason": self.disabled_reason,
            "disabled_at": None if self.disabled_at is None else self.disabled_at.isoformat(),
            "failing_since": (
                None if self.failing_since is None else self.failing_since.isoformat()
            ),
            "failing_for_seconds": (
                None if self.failing_for_s is None else round(max(0.0, self.failing_for_s), 3)
            ),
            "pending": self.pending,
            "pending_estimated": self.capped,
            "parked": self.parked,
        }


@dataclass(frozen=True, slots=True)
class EndpointHealth:
    """The worst endpoints and totals over all of them."""

    worst: list[EndpointState]
    endpoints: int
    disabled: int
    failing: int  # enabled, with a failure streak
    pending: int  # over every endpoint (each counted up to the cap)
    cap: int


async def read_endpoint_health(
    conn: psycopg.AsyncConnection[Any],
    limit: int,
    cap: int = ENDPOINT_COUNT_CAP,
    *,
    timeout_ms: int | None = None,
) -> EndpointHealth:
    """The ``limit`` worst endpoints (disabled by the dispatcher, then the longest failure
    streak, then the largest backlog) and totals over every endpoint. Pending deliveries
    are counted up to ``cap`` per endpoint from the partial index of pending deliveries:
    a reading's cost is bounded by the number of endpoints times ``cap`` index entries.
    ``timeout_ms``: the server gives up on the reading after that long (a background
    reading must not run on when a huge backlog makes it slow)."""
    cur = conn.cursor(row_factory=dict_row)
    params = {"limit": max(limit, 1), "cap": cap}
    if timeout_ms is None:
        await cur.execute(query("endpoint_health"), params)
    else:
        async with conn.transaction():
            await cur.execute(
                "SELECT set_config('statement_timeout', %s, true)", (str(timeout_ms),)
            )
            await cur.execute(query("endpoint_health"), params)
    rows = await cur.fetchall()
    if not rows:
        return EndpointHealth([], 0, 0, 0, 0, cap)
    worst = [
        EndpointState(
            id=r["id"],
            tenant=r["tenant"],
            state=r["state"],
            disabled_reason=r["disabled_reason"],
            disabled_at=r["disabled_at"],
            failing_since=r["failing_since"],
            failing_for_s=r["failing_for_s"],
            pending=int(r["pending"]),
            parked=int(r["parked"]),
            capped=int(r["pending"]) >= cap,
        )
        for r in rows
    ]
    first = rows[0]
    return EndpointHealth(
        worst[:limit],
        int(first["endpoints_total"]),
        int(first["disabled_total"]),
        int(first["failing_total"]),
        int(first["pending_total"] or 0),
        cap,
    )


async def read_last_errors(
    conn: psycopg.AsyncConnection[Any], ids: list[str]
) -> dict[str, dict[str, Any]]:
    """The last failure of each endpoint of ``ids`` that has one (status code, the stored
    error text, when)."""
    if not ids:
        return {}
    cur = conn.cursor(row_factory=dict_row)
    await cur.execute(query("endpoint_last_errors"), {"ids": ids})
    return {
        r["id"]: {
            "status_code": r["status_code"],
            "error": r["error"],
            "at": r["at"].isoformat() if r["at"] is not None else None,
        }
        for r in await cur.fetchall()
    }


def set_endpoint_gauges(health: EndpointHealth) -> None:
    """The per-endpoint series: the worst :data:`METRIC_ENDPOINTS` by name, the rest as one
    (see :class:`fluxora_webhooks.metrics.EndpointCollector`)."""
    metrics.ENDPOINTS_COLLECTOR.update(
        [
            metrics.EndpointReading(
                e.id, e.tenant, e.pending, max(0.0, e.failing_for_s or 0.0), e.state == "disabled"
            )
            for e in health.worst[:METRIC_ENDPOINTS]
        ],
        total_pending=health.pending,
        endpoints=health.endpoints,
        disabled=health.disabled,
        failing=health.failing,
    )


async def read_recent_outcomes(
    conn: psycopg.AsyncConnection[Any], window_ms: int
) -> list[dict[str, Any]]:
    """Attempts completed within the last ``window_ms``, one row per outcome (attempts,
    p50/p95 duration, last time)."""
    cur = conn.cursor(row_factory=dict_row)
    await cur.execute(query("recent_outcomes"), {"window_ms": window_ms})
    return list(await cur.fetchall())


async def read_status(
    database_url: str,
    *,
    minutes: int,
    webhook_url: str | None,
    redis_url: str | None,
    redis_prefix: str = "",
    breaker_threshold: int | None = None,
    endpoints: int = STATUS_ENDPOINTS,
) -> dict[str, Any]:
    """Everything ``status`` shows, as a JSON-ready dict (``endpoints``: how many of the
    worst endpoints)."""
    async with await open_session(database_url, autocommit=True, connect_timeout=10) as conn:
        await check_schema(conn)
        backlog = await read_backlog(conn, STATUS_COUNT_CAP)
        held = await read_egress_held(conn, STATUS_COUNT_CAP)
        recent = await read_recent_outcomes(conn, minutes * 60_000)
        health = await read_endpoint_health(conn, endpoints)
        errors = await read_last_errors(conn, [e.id for e in health.worst])
        now_row = await (await conn.execute("SELECT now()")).fetchone()
    assert now_row is not None
    by_outcome = {r["outcome"]: r for r in recent}
    out: dict[str, Any] = {
        "at": now_row[0].isoformat(),
        "backlog": {
            "pending": backlog.pending,
            "due_now": backlog.due,
            "oldest_due_age_seconds": round(backlog.oldest_due_age_s, 3),
            "next_due_in_seconds": (
                None if backlog.next_due_in_s is None else round(backlog.next_due_in_s, 3)
            ),
            "estimated": backlog.capped,
            # Held by an outage of the egress proxy (WEBHOOK_PROXY_URL): no consumer asked.
            "egress_held": held,
        },
        "dead_letters": {"waiting": backlog.dead_letters},
        "recent": {
            "minutes": minutes,
            "attempts": {
                o: int(by_outcome[o]["attempts"]) if o in by_outcome else 0
                for o in RECORDED_OUTCOMES
            },
            "duration_ms": {
                o: {"p50": _ms(by_outcome[o]["p50_ms"]), "p95": _ms(by_outcome[o]["p95_ms"])}
                for o in RECORDED_OUTCOMES
                if o in by_outcome
            },
            "last_at": (max(r["last_at"] for r in recent).isoformat() if recent else None),
            # Events that matched no endpoint of their tenant (a misspelt tenant, a type
            # nobody subscribes to): processed, sent nowhere.
            "unrouted_events": (
                int(by_outcome[Outcome.UNROUTED]["attempts"])
                if Outcome.UNROUTED in by_outcome
                else 0
            ),
        },
        "endpoints": {
            "total": health.endpoints,
            "disabled": health.disabled,
            "failing": health.failing,
            "pending": health.pending,
            "counted_up_to": health.cap,
            "worst": [{**e.as_json(), "last_error": errors.get(e.id)} for e in health.worst],
        },
        "consumer": None,
    }
    if webhook_url:
        out["consumer"] = await read_consumer(
            webhook_url, redis_url, redis_prefix, breaker_threshold
        )
    return out


def _ms(value: Any) -> float | None:
    return None if value is None else round(float(value), 2)


async def read_consumer(
    webhook_url: str, redis_url: str | None, prefix: str, threshold: int | None
) -> dict[str, Any]:
    """The consumer's shared breaker and rate-limit window, read from Redis (never raises
    for Redis: an unreachable Redis is part of the answer)."""
    consumer: dict[str, Any] = {
        "endpoint": redacted(webhook_url),
        "redis": {"url": scrub(redis_url) if redis_url else None, "reachable": False},
        "breaker": None,
        "rate_limit": None,
    }
    if not redis_url:
        consumer["redis"]["error"] = "REDIS_URL is not set"
        return consumer
    client = client_for(
        redis_url, socket_connect_timeout=REDIS_TIMEOUT_S, socket_timeout=REDIS_TIMEOUT_S
    )
    try:
        async with asyncio.timeout(3 * REDIS_TIMEOUT_S):
            seconds, micros = await client.time()
            now_ms = int(seconds) * 1000 + int(micros) // 1000
            state = await read_breaker_state(client, webhook_url, prefix)
            window = await client.zcount(
                rate_limit_key(webhook_url, prefix), now_ms - RATE_WINDOW_MS + 1, "+inf"
            )
    except Exception as exc:  # unreachable, auth, timeout: say so, do not fail
        text = scrub(str(exc)).strip()
        consumer["redis"]["error"] = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
        return consumer
    finally:
        await client.aclose()
    consumer["redis"]["reachable"] = True
    consumer["breaker"] = {
        "enabled": None if threshold is None else threshold > 0,
        "threshold": threshold,
        "state": state.state,
        "failures": state.failures,
        "reset_in_seconds": (
            round(max(0, state.reset_at_ms - now_ms) / 1000, 3) if state.state == "open" else None
        ),
        "probe_in_flight": bool(state.probe_token),
    }
    consumer["rate_limit"] = {"attempts_last_second": int(window)}
    return consumer
