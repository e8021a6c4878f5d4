"""What the integration commands read and write (SPEC 18): ``send``'s test event and the
deliveries it was routed to, and ``tail``'s attempts as they are recorded.

Delivery ids: an event's row carries one from the start (the built-in ``default``
endpoint's, which :func:`~fluxora_webhooks.outbox.enqueue` returns), but the deliveries to
the table's endpoints are written, each with a delivery id of its own, when a dispatcher
claims the event and routes it (``complete_batch``, in the claim transaction). Which
endpoints an event reaches is decided there and only there (endpoints may change until
then), so ``send`` does not guess: it waits, bounded, until a dispatcher has routed the
event and reads the delivery rows the routing wrote (:func:`wait_routed`).

``tail`` reads the attempts recorded on the outbox (a row's ``processed_at``, ``outcome``,
``status_code``, ``duration_ms``) through ``webhook_outbox_processed_at_idx``, the tenant
and endpoint scope in the query. Nothing is added to the dispatcher's path (no NOTIFY per
attempt): :class:`AttemptCursor` polls. ``processed_at`` is written by the recording
statement, a moment before its transaction commits, so each poll looks
:data:`LOOKBACK_S` back and skips what it showed already: an attempt committed later than
that after it was recorded is not shown (a view, not a ledger).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg.rows import dict_row

from .endpoints import DEFAULT_ID, OPERATOR_TENANT
from .outbox import enqueue
from .pgtypes import as_utc
from .queries import query

LOOKBACK_S = 2.0
TAIL_PAGE = 500
ROUTING_POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class Sent:
    """An event ``send`` wrote: its row, and the delivery id enqueue returned."""

    event_id: int
    partition_at: datetime
    delivery_id: str


@dataclass(frozen=True, slots=True)
class Routing:
    """Where an event went: ``routing`` as the API's event says it (``pending`` until a
    dispatcher routed it, ``routed``, ``unrouted``: no endpoint of its tenant subscribed to
    its type, ``dead_letter``: its fan-out was refused); ``deliveries`` as (endpoint id,
    delivery id), by endpoint id."""

    routing: str = "pending"
    deliveries: tuple[tuple[str, str], ...] = ()

    @property
    def routed(self) -> bool:
        """Whether a dispatcher routed it (to no endpoint, maybe)."""
        return self.routing != "pending"


async def send_event(
    conn: psycopg.AsyncConnection[Any],
    *,
    tenant: str,
    event_type: str,
    payload: Any,
    stream_id: str,
) -> Sent:
    """Enqueue one event through :func:`~fluxora_webhooks.outbox.enqueue`, committed."""
    async with conn.transaction():
        delivery_id = await enqueue(
            conn, tenant=tenant, stream_id=stream_id, event_type=event_type, payload=payload
        )
        cur = await conn.execute(query("sent_event"), {"delivery_id": delivery_id})
        row = await cur.fetchone()
    assert row is not None
    return Sent(int(row[0]), row[1], delivery_id)


async def read_routing(conn: psycopg.AsyncConnection[Any], sent: Sent) -> Routing:
    params = {"id": sent.event_id, "partition_at": sent.partition_at}
    cur = await conn.execute(query("event_routing"), params)
    row = await cur.fetchone()
    if row is None:  # pruned: long routed
        return Routing("routed")
    endpoint_id, processed, outcome, delivery_id = row
    if endpoint_id is None and not processed:
        return Routing()
    if outcome in ("unrouted", "dead_letter") and endpoint_id is None:
        return Routing(outcome)
    cur = await conn.execute(query("event_deliveries"), {"id": sent.event_id})
    found = {str(e): str(d) for e, d in await cur.fetchall()}
    if endpoint_id == DEFAULT_ID:
        found[DEFAULT_ID] = delivery_id  # the event row is the default endpoint's delivery
    return Routing("routed", tuple(sorted(found.items())))


async def wait_routed(conn: psycopg.AsyncConnection[Any], sent: Sent, timeout_s: float) -> Routing:
    """The event's routing once a dispatcher has routed it, or ``Routing()`` (pending) after
    ``timeout_s`` (no dispatcher running, or all busy)."""
    deadline = time.monotonic() + timeout_s
    while True:
        routing = await read_routing(conn, sent)
        if routing.routed or time.monotonic() >= deadline:
            return routing
        await asyncio.sleep(min(ROUTING_POLL_S, max(0.0, deadline - time.monotonic())))


@dataclass(frozen=True, slots=True)
class Attempt:
    """One recorded attempt, as ``tail`` shows it."""

    id: int
    at: datetime
    delivery_id: str
    tenant: str | None  # None: the operator endpoint's events (no tenant's), as the API says
    endpoint_id: str | None
    event_type: str
    stream_id: str
    attempt: int
    outcome: str
    status_code: int | None
    duration_ms: float | None
    error: str | None

    def as_json(self) -> dict[str, Any]:
        return {
            "at": self.at.isoformat(),
            "delivery_id": self.delivery_id,
            "tenant": self.tenant,
            "endpoint_id": self.endpoint_id,
            "event_type": self.event_type,
            "stream_id": self.stream_id,
            "attempt": self.attempt,
            "outcome": self.outcome,
            "status_code": self.status_code,
            "duration_ms": None if self.duration_ms is None else round(self.duration_ms, 2),
            "error": self.error,
        }


@dataclass
class AttemptCursor:
    """Attempts recorded from ``start`` on (the database's clock), of ``tenant`` and/or
    ``endpoint`` when given, each returned once by :meth:`poll`."""

    start: datetime
    tenant: str | None = None
    endpoint: str | None = None
    lookback: timedelta = timedelta(seconds=LOOKBACK_S)
    _high: datetime | None = None
    _seen: dict[int, datetime] = field(default_factory=dict)

    async def poll(self, conn: psycopg.AsyncConnection[Any]) -> list[Attempt]:
        """The attempts recorded since the last poll (committed since, within the
        lookback), oldest first."""
        after = self.start if self._high is None else max(self.start, self._high - self.lookback)
        after_id = 0
        out: list[Attempt] = []
        cur = conn.cursor(row_factory=dict_row)
        while True:
            await cur.execute(
                query("tail_attempts"),
                {
                    "after": after,
                    "after_id": after_id,
                    "tenant": self.tenant,
                    "endpoint": self.endpoint,
                    "limit": TAIL_PAGE,
                },
            )
            rows = await cur.fetchall()
            for row in rows:
                if row["id"] in self._seen:
                    continue
                self._seen[row["id"]] = as_utc(row["processed_at"])  # compared, subtracted
                out.append(_attempt(row))
            if len(rows) < TAIL_PAGE:
                break
            after, after_id = rows[-1]["processed_at"], rows[-1]["id"]
        if self._seen:
            self._high = max(self._seen.values())
            horizon = self._high - self.lookback
            self._seen = {i: at for i, at in self._seen.items() if at >= horizon}
        return out


def _attempt(row: dict[str, Any]) -> Attempt:
    return Attempt(
        id=int(row["id"]),
        at=row["processed_at"],
        delivery_id=row["delivery_id"],
        tenant=None if row["tenant"] == OPERATOR_TENANT else row["tenant"],
        endpoint_id=row["endpoint_id"],
        event_type=row["event_type"],
        stream_id=row["stream_id"],
        attempt=int(row["attempt"]),
        outcome=row["outcome"],
        status_code=row["status_code"],
        duration_ms=row["duration_ms"],
        error=row["error"],
    )


async def database_now(conn: psycopg.AsyncConnection[Any]) -> datetime:
    cur = await conn.execute(query("tail_now"))
    row = await cur.fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]
