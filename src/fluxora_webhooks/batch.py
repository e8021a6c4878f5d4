"""One batch: a claim transaction, from the claim to the commit.

::

    BEGIN
      claim_due (FOR UPDATE SKIP LOCKED)           -- event rows and delivery rows
      plan: each row's endpoint; parked if it is disabled, deferred if it is saturated
      gate.admit per URL (Redis: rate limit + circuit breaker)
      POST the admitted rows concurrently; a request that outlives the batch's patience
        (or goes to an endpoint that is slow right now) is detached under a lease
      complete (one statement): outcomes, holds, retries, dead letters, the fan-out of
        the event rows, failure streaks; then ordered streams' next heads, auto-disable
    COMMIT

A crash before COMMIT releases the locks and the rows are claimed again: at-least-once. A
detached request goes on after the commit and is recorded by the :class:`Completer`; if its
dispatcher dies, the lease ends and the row is due again. So a slow endpoint never holds
a batch of healthy ones, and its requests never occupy claim capacity.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

import psycopg

from . import metrics
from .delivery import AttemptResult
from .endpoints import DEFAULT_ID
from .gate import Admission
from .outbox import Claimed, Completion, Outcome, Recorded, claim_due, next_due_in_ms
from .retry import Decision, Kind
from .targets import Target

if TYPE_CHECKING:
    from .dispatcher import Dispatcher

log = logging.getLogger("fluxora_webhooks.dispatcher")

# A batch waits this long for its requests; one still running then is detached.
PATIENCE_S = 0.25
# A lease outlives its request's timeout by this much.
LEASE_GRACE_MS = 5_000
# A delivery to an endpoint this process has no configuration for (a built-in endpoint
# of another configuration) waits this long before it is looked at again.
UNKNOWN_ENDPOINT_DEFER_MS = 10_000
GONE = 410


@dataclass
class Send:
    """A row being sent: its endpoint, its admission and its request."""

    row: Claimed
    target: Target
    admission: Admission
    task: asyncio.Task[AttemptResult] | None = None
    # Planned while its endpoint's slots were all taken: the request waits for one.
    queued: bool = False
    started: bool = False  # its request was sent (it holds a slot)
    # Set when the request outlives its batch; its row is recorded under this lease once
    # the batch's commit has written it (lease_written).
    lease: uuid.UUID | None = None
    committed: asyncio.Event = field(default_factory=asyncio.Event)
    lease_written: bool = False

    @property
    def endpoint_id(self) -> str:
        return self.target.id


class Batch:
    """One claim transaction of a :class:`~fluxora_webhooks.dispatcher.Dispatcher`."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.d = dispatcher
        self.completions: list[Completion] = []
        self.sends: list[Send] = []
        self.route: list[int] = []
        self.claimed = 0
        self.parts: dict[int, datetime | None] = {}  # each claimed row's partition_at
        # Filled when recorded: the attempts decided in the batch, and how many deliveries
        # of ordered streams became due.
        self.done: list[tuple[Send, AttemptResult, Decision]] = []
        self.promoted = 0

    async def run(self, conn: psycopg.AsyncConnection[Any]) -> tuple[int, int | None]:
        """Returns (rows claimed, ms until the next future due row)."""
        settings = self.d.settings
        async with conn.transaction():
            since = self.d.claim_since
            rows = await claim_due(conn, settings.batch_size, since=since)
            self.claimed = len(rows)
            self.parts = {row.id: row.partition_at for row in rows}
            if rows:
                await self._plan(conn, rows)
                await self._send()
                await self.d.recorder.record(conn, self)
            next_due = (
                await next_due_in_ms(conn, since=since) if len(rows) < settings.batch_size else 0
            )
        self.d.after_commit(self)
        return len(rows), next_due

    # -- planning ---------------------------------------------------------------------

    async def _plan(self, conn: psycopg.AsyncConnection[Any], rows: Sequence[Claimed]) -> None:
        candidates: list[tuple[Claimed, Target]] = []
        queued: set[int] = set()  # rows that will wait in this process for a slot
        for row in rows:
            if row.is_event:
                self.route.append(row.id)
                # The built-in default endpoint is the default tenant's (every event type).
                default = (
                    self.d.targets.get(DEFAULT_ID)
                    if self.d.targets.has_default and row.tenant == ""
                    else None
                )
                if default is None:
                    self.completions.append(Completion(row.id, Outcome.ROUTED))
                    continue
                target = default
            else:
                found = await self._target(conn, row)
                if found is None:
                    continue
                target = found
            endpoint_id = DEFAULT_ID if row.is_event else None
            if not target.enabled:
                # The cache may be a moment behind an enable (its NOTIFY is on its way):
                # the registry decides before a row is parked.
                target = await self.d.targets.reload(conn, target.id) or target
            if not target.enabled:
                self.completions.append(Completion(row.id, Outcome.PARKED, endpoint_id=endpoint_id))
                continue
            wait = self.d.capacity_wait_s(target)
            queue = wait is not None and self.d.may_wait_for_slot(target)
            if wait is not None and not queue:
                self.completions.append(
                    Completion(row.id, Outcome.DEFERRED, delay_ms=max(1, int(wait * 1000)),
                               endpoint_id=endpoint_id)
                )  # fmt: skip
                continue
            if queue:
                queued.add(row.id)
            else:
                target.load.in_flight += 1  # reserved now: later rows of this batch see it
            candidates.append((row, target))
        admissions = await self.d.admit(candidates)
        for (row, target), admission in zip(candidates, admissions, strict=True):
            if admission.allowed:
                self.sends.append(Send(row, target, admission, queued=row.id in queued))
                continue
            if row.id not in queued:
                target.load.release()
            self.completions.append(
                Completion(
                    row.id,
                    Outcome.DEFERRED,
                    delay_ms=max(admission.delay_ms, 1),
                    endpoint_id=DEFAULT_ID if row.is_event else None,
                )
            )

    async def _target(self, conn: psycopg.AsyncConnection[Any], row: Claimed) -> Target | None:
        """The row's endpoint. Unknown here: reloaded from the registry; an endpoint gone
        from it was removed (its delivery becomes a dead letter, as removal promises); a
        built-in endpoint this dispatcher is not configured for waits."""
        assert row.endpoint_id is not None
        target = self.d.targets.get(row.endpoint_id)
        if target is not None:
            return target
        target = await self.d.targets.reload(conn, row.endpoint_id)
        if target is not None:
            return target
        if row.endpoint_id in (DEFAULT_ID, "operator"):
            self.d.warn_unconfigured(row.endpoint_id)
            self.completions.append(
                Completion(row.id, Outcome.DEFERRED, delay_ms=UNKNOWN_ENDPOINT_DEFER_MS)
            )
            return None
        exists = await conn.execute(
            "SELECT 1 FROM webhook_endpoints WHERE id = %s", (row.endpoint_id,)
        )
        if await exists.fetchone() is not None:  # a built-in of another configuration
            self.completions.append(
                Completion(row.id, Outcome.DEFERRED, delay_ms=UNKNOWN_ENDPOINT_DEFER_MS)
            )
            return None
        self.completions.append(
            Completion(
                row.id,
                Outcome.DEAD_LETTER,
                error="endpoint removed",
                reason="endpoint_removed",
            )
        )
        return None

    # -- sending ----------------------------------------------------------------------

    async def _send(self) -> None:
        if not self.sends:
            return
        inline: list[Send] = []
        for send in self.sends:
            send.task = asyncio.create_task(self.d.send(send))
            if send.target.load.slow:
                self._detach(send)
            else:
                inline.append(send)
        tasks = [s.task for s in inline if s.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=PATIENCE_S)
        for send in inline:
            assert send.task is not None
            if not send.task.done():
                if send.started:  # a request that outlived the batch, not a wait for a slot
                    send.target.load.mark_slow()
                self._detach(send)

    def _detach(self, send: Send) -> None:
        """Let the request outlive the batch: the row is leased (due again only after the
        request's timeout and a margin) and the Completer records its outcome."""
        send.lease = uuid.uuid4()
        self.d.completer.detached()
        self.completions.append(
            Completion(
                send.row.id,
                Outcome.LEASED,
                delay_ms=self.d.settings.timeout_ms + LEASE_GRACE_MS,
                endpoint_id=DEFAULT_ID if send.row.is_event else None,
                lease=send.lease,
            )
        )
        metrics.DETACHED.inc()

    def finished(self) -> list[tuple[Send, AttemptResult]]:
        """The sends whose request ended within the batch."""
        out = []
        for send in self.sends:
            if send.lease is None:
                assert send.task is not None and send.task.done()
                out.append((send, send.task.result()))
        return out


@dataclass
class Effects:
    """What recording a set of attempts leads to besides the rows: streaks, ordered
    streams whose next head may go, endpoints to disable."""

    succeeded: set[str]
    failed: set[str]
    ordered: list[tuple[str, str]]
    gone: set[str]


def outcome_of(
    dispatcher: Dispatcher, send: Send, result: AttemptResult, *, lease: uuid.UUID | None = None
) -> tuple[Completion, Decision]:
    """The completion of one attempt (a 410 parks the delivery: its endpoint is disabled)."""
    row = send.row
    endpoint_id = DEFAULT_ID if row.is_event else None
    if result.status == GONE and not send.target.builtin:
        decision = Decision(Outcome.PARKED, reason="gone")
        return (
            Completion(
                row.id,
                Outcome.PARKED,
                status_code=result.status,
                error=result.error,
                response_body=result.body,
                duration_ms=result.duration_ms,
                endpoint_id=endpoint_id,
                lease=lease,
            ),
            decision,
        )
    decision = dispatcher.policy.decide(
        row.attempt, result.kind, reason=result.reason, retry_after_ms=result.retry_after_ms
    )
    dispatcher.log_decision(row, send.target, result, decision)
    return (
        Completion(
            row.id,
            decision.outcome,
            delay_ms=decision.delay_ms,
            status_code=result.status,
            error=result.error,
            response_body=result.body,
            duration_ms=result.duration_ms,
            reason=decision.reason,
            endpoint_id=endpoint_id,
            lease=lease,
        ),
        decision,
    )


def effects_of(done: Sequence[tuple[Send, AttemptResult, Decision]]) -> Effects:
    effects = Effects(set(), set(), [], set())
    for send, result, decision in done:
        endpoint = send.target.id
        if result.kind is Kind.DELIVERED:
            effects.succeeded.add(endpoint)
        else:
            effects.failed.add(endpoint)
        if decision.reason == "gone":
            effects.gone.add(endpoint)
        if send.row.stream_seq is not None and decision.outcome in (
            Outcome.DELIVERED,
            Outcome.DEAD_LETTER,
        ):
            effects.ordered.append((endpoint, send.row.stream_id))
    return effects


async def apply_effects(
    dispatcher: Dispatcher,
    conn: psycopg.AsyncConnection[Any],
    recorded: Recorded,
    effects: Effects,
) -> int:
    """In the recording transaction, after its statement: the next heads of ordered
    streams, and endpoints disabled (410 Gone at once; failing for longer than
    ``WEBHOOK_DISABLE_AFTER``). Returns how many deliveries became due."""
    from . import endpoints
    from .outbox import promote_heads

    for endpoint_id in sorted(effects.gone):
        await endpoints.disable(conn, endpoint_id, reason="gone")
        dispatcher.note_disabled(endpoint_id, "gone")
    after = dispatcher.settings.disable_after_ms
    candidates = sorted(effects.failed - effects.succeeded - effects.gone)
    if after and candidates:
        cur = await conn.execute(
            "SELECT id FROM webhook_endpoints WHERE id = ANY(%s) AND state = 'enabled'"
            " AND id <> 'operator' AND failing_since <= clock_timestamp()"
            " - %s * interval '1 millisecond'",
            (candidates, after),
        )
        for (endpoint_id,) in await cur.fetchall():
            await endpoints.disable(conn, str(endpoint_id), reason="failing")
            dispatcher.note_disabled(str(endpoint_id), "failing")
    return await promote_heads(conn, [*recorded.ordered, *effects.ordered])


def breaker_signal(result: AttemptResult) -> bool | None:
    if result.kind is Kind.DELIVERED:
        return True
    if result.kind is Kind.RETRYABLE:
        return False
    return None
