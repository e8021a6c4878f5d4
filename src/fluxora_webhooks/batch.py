"""One batch: a claim transaction, from the claim to the commit.

::

    BEGIN
      claim_due (FOR UPDATE SKIP LOCKED)           -- event rows and delivery rows
      route_events: the event rows' fan-out; up to ROUTED_IN_BATCH of its due deliveries join
      plan: each row's endpoint; parked if it is disabled, deferred if it is saturated
      gate.admit per URL (Redis: rate limit + circuit breaker)
      POST the admitted rows concurrently; a request that outlives the batch's patience
        (or goes to an endpoint that is slow right now) is detached under a lease
      complete (one statement): outcomes, holds, retries, dead letters, failure
        streaks; then ordered streams' next heads, auto-disable
    COMMIT

A crash before COMMIT releases the locks and the rows are claimed again: at-least-once (an
event routed again gives its deliveries the same ids, so a consumer can tell a repeat). A
detached request goes on after the commit and is recorded by the :class:`Completer`; if its
dispatcher dies, the lease ends and the row is due again. So a slow endpoint never holds
a batch of healthy ones, and its requests never occupy claim capacity.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

import psycopg
import psycopg.errors
from psycopg_pool import PoolTimeout

from . import metrics
from .delivery import EGRESS, EGRESS_HELD, HELD, AttemptResult
from .endpoints import DEFAULT_ID
from .errors import NotFoundError
from .gate import ANSWERED, Admission, Signal
from .outbox import (
    Claimed,
    Completion,
    Outcome,
    Recorded,
    claim_due,
    next_due_in_ms,
    route_events,
    try_lock_streams,
    try_promote_heads,
)
from .pgtypes import as_utc
from .retry import Decision, Kind, RetryPolicy
from .targets import Target

if TYPE_CHECKING:
    from .dispatcher import Dispatcher

log = logging.getLogger("fluxora_webhooks.dispatcher")

# Errors after which nothing more is tried on the connection: psycopg's OperationalError (the
# database unreachable, or the statement cancelled, timed out or deadlocked), a broken
# connection, no connection to be had. Any other psycopg.Error is a statement refused.
# A prepared statement the session does not have, or has twice: the connection's doing (a
# pooler in transaction mode handed it another session's), never the rows'.
DB_ERRORS = (
    psycopg.OperationalError,
    psycopg.InterfaceError,
    PoolTimeout,
    psycopg.errors.InvalidSqlStatementName,
    psycopg.errors.DuplicatePreparedStatement,
)
# Among DB_ERRORS, what refuses one statement for what its rows hold (an index entry past
# the btree's limit: a stream id written by SQL thousands of characters long): the rows are
# at fault, not the database, so they are recorded one by one as after any other refused
# statement. Taken for an outage, the batch would be claimed again, and fail, for ever.
REFUSED_ERRORS = (psycopg.errors.ProgramLimitExceeded,)


def outage(exc: BaseException) -> bool:
    """Whether nothing more is to be tried on the connection after ``exc`` (one of
    DB_ERRORS that is not among REFUSED_ERRORS)."""
    return isinstance(exc, DB_ERRORS) and not isinstance(exc, REFUSED_ERRORS)


# Errors among DB_ERRORS that undo only the statement's savepoint, not the connection.
SAVEPOINT_ONLY_ERRORS = (
    psycopg.errors.DeadlockDetected,
    psycopg.errors.LockNotAvailable,
    psycopg.errors.QueryCanceled,  # the statement_timeout of the dispatcher's sessions
)

# The limits of a claim connection's session (Dispatcher._configure_connection): a lock that
# never comes, a statement that never ends. A batch's recording lifts both for the rest of
# its transaction (complete_batch): its requests have gone out, and its COMMIT must not give
# up and send them again.
LOCK_TIMEOUT_MS = 10_000
STATEMENT_TIMEOUT_MS = 60_000
# How long disabling an endpoint waits for its row (an operator's or the API's transaction
# holding it) before it is left to the endpoint's next failure.
DISABLE_LOCK_TIMEOUT_MS = LOCK_TIMEOUT_MS
_BOUNDED_WAITS = (
    "SELECT set_config('lock_timeout', %s, true), set_config('statement_timeout', %s, true)"
)

# A batch waits this long for its requests; one still running then is detached.
PATIENCE_S = 0.25
# A request to an endpoint that has not answered while the rest of its batch has is
# waited for this many times as long as the batch took so far, at least STRAGGLER_MIN_S.
STRAGGLER_FACTOR = 2.0
STRAGGLER_MIN_S = 0.01
# A batch that routes events sends up to this many of the deliveries it routed itself (at
# least a batch; more only while the process has connections to spare: Batch._routed_cap):
# a claim of a few events to ten endpoints each sends all their deliveries at once rather
# than leaving most to later claims (docs/performance.md, eleventh pass).
ROUTED_IN_BATCH = 100
# A lease outlives its request's timeout by this much.
LEASE_GRACE_MS = 5_000
# A delivery to an endpoint this process has no configuration for (a built-in endpoint
# of another configuration) waits this long before it is looked at again.
UNKNOWN_ENDPOINT_DEFER_MS = 10_000
# What a delivery whose endpoint's secret no key of this dispatcher opens waits for (its
# wait_reason; no key id: tenants read it, the dispatcher's log names the key).
LOCKED_WAIT = (
    "held: its endpoint's secret is encrypted with a key this dispatcher does not have"
    " (WEBHOOK_ENCRYPTION_KEY); it is sent when a dispatcher with that key runs"
)
GONE = 410
# A claim loop that keeps claiming full batches resumes each claim after its previous batch
# (Resume); at least this often it claims from the start of the index again.
FULL_CLAIM_EVERY_S = 1.0


def recorded_endpoint(row: Claimed) -> str | None:
    """The endpoint a row's outcome is written with: an event row sent as the default
    endpoint's delivery becomes that delivery (None: the row's own endpoint)."""
    return DEFAULT_ID if row.is_event else None


def deferral(row: Claimed, delay_ms: int, why: str | None = None) -> Completion:
    """``row`` back in the outbox, due again in ``delay_ms`` (at least 1), no attempt spent;
    ``why``: what it says while it waits (its row's error), none for a passing deferral."""
    return Completion(
        row.id, Outcome.DEFERRED, delay_ms=max(1, delay_ms), error=why,
        endpoint_id=recorded_endpoint(row),
    )  # fmt: skip


@dataclass(eq=False)
class Send:
    """A row being sent: its endpoint, its admission and its request (each one itself:
    compared and hashed by identity)."""

    row: Claimed
    target: Target
    admission: Admission
    task: asyncio.Task[AttemptResult] | None = None
    # Planned while its endpoint's slots were all taken: the request waits for one.
    queued: bool = False
    started: bool = False  # its request was sent (it holds a slot)
    started_at: float = 0.0  # time.monotonic() then
    # Set when the request outlives its batch; its row is recorded under this lease once
    # the batch's commit has written it (lease_written).
    lease: uuid.UUID | None = None
    # Set once the batch has committed or rolled back; made with the lease (only a request
    # that outlives its batch waits for it).
    committed: asyncio.Event | None = None
    lease_written: bool = False
    # Not sent (the detached requests held their share): its row deferred.
    withheld: bool = False

    @property
    def endpoint_id(self) -> str:
        return self.target.id


def full_batch_end(rows: Sequence[Claimed], batch_size: int) -> tuple[datetime, int] | None:
    """The claim index position (created_at, id) of a full batch's last row; None for a
    batch that was not full. In UTC (pgtypes.as_utc): positions are compared."""
    last = rows[-1] if len(rows) >= batch_size else None
    return None if last is None or last.created_at is None else (as_utc(last.created_at), last.id)


@dataclass
class ClaimFront:
    """How far the claims of a process's loops have looked, without a gap, since the last
    claim from the start of the index: the last row of the furthest full batch whose claim
    began at or before that point (a claim from the start begins before everything). Every
    row up to it was claimed by a loop or locked by another transaction when a claim went
    past it, so a loop whose own position lies behind it resumes there instead of walking
    past its siblings' batches (SKIP LOCKED reads every locked row it skips). A claim from
    the start sets it to its own last row: what it found proves the rows behind the old
    front are not all taken (late rows), and the loops walk them again. Moved as the claim
    returns, not at its commit; cleared when a batch of the process rolls back (its rows
    are claimable again, behind it)."""

    at: tuple[datetime, int] | None = None

    def advance(
        self, start: tuple[datetime, int] | None, rows: Sequence[Claimed], batch_size: int
    ) -> None:
        """A claim that began at ``start`` (None: the start of the index) returned ``rows``."""
        position = full_batch_end(rows, batch_size)
        if position is None:
            return
        # From the start, or from no further than the front and past it: no gap.
        if start is None or (self.at is not None and start <= self.at < position):
            self.at = position

    def clear(self) -> None:
        self.at = None


@dataclass
class Resume:
    """Where a claim loop's next claim starts looking.

    The rows a batch completes leave their entries in the claim's partial index until VACUUM
    removes them, and a claim from the start of the index walks all of them: a burst of
    thousands of rows made each claim read hundreds of index pages more, for the same ten
    rows, until autovacuum came. So after a full batch the next claim looks only after that
    batch's last row, or after the process's ``front`` when that is further: the rows
    between were taken by the process's other loops (:class:`ClaimFront`). What it cannot
    see then, a row before that position that became claimable late (its claim rolled back,
    its dispatcher died, its producer's transaction began before the batch's rows were
    written and committed after), the next claim from the start finds: after a batch that
    was not full, and at least every FULL_CLAIM_EVERY_S. Retries and deferrals are due
    after the position (their due time is the clock after the requests); a row another
    transaction makes due as of its own start (an ordered stream's next head, an event it
    routes, parked rows an enable resumes) may be behind it, and waits for that claim from
    the start."""

    after: tuple[datetime, int] | None = None
    full_at: float = float("-inf")  # time.monotonic() of the last claim from the start
    front: ClaimFront = field(default_factory=ClaimFront)  # shared by a process's loops

    def position(self) -> tuple[datetime, int] | None:
        """Where the next claim starts: None for the start of the index."""
        now = time.monotonic()
        if self.after is None or now - self.full_at >= FULL_CLAIM_EVERY_S:
            self.full_at = now
            return None
        front = self.front.at
        return front if front is not None and front > self.after else self.after

    def claimed(self, rows: Sequence[Claimed], batch_size: int) -> None:
        self.after = full_batch_end(rows, batch_size)


class Batch:
    """One claim transaction of a :class:`~fluxora_webhooks.dispatcher.Dispatcher`."""

    def __init__(self, dispatcher: Dispatcher, resume: Resume | None = None) -> None:
        self.d = dispatcher
        self.resume = resume if resume is not None else Resume()
        # Endpoints whose registry row this batch read again (see _target).
        self.reread: set[str] = set()
        self.completions: list[Completion] = []
        self.sends: list[Send] = []
        self.claimed = 0
        self.parts: dict[int, datetime | None] = {}  # each planned row's partition_at
        self.events: list[int] = []  # the claimed event rows
        self.for_default: set[int] = set()  # those the default endpoint delivers itself
        # Event rows routed by the completion statement: those of tenants with no endpoint
        # known to this dispatcher (nothing to send in the batch, so no statement of its own).
        self.route: list[int] = []
        # The event rows route_events routed to an endpoint, and the ordered streams whose
        # next head the batch chooses once recorded; route_failed: it was rejected.
        self.prerouted: frozenset[int] = frozenset()
        self.routed_ordered: list[tuple[str, str]] = []
        # Ordered pairs whose delivery route_events made due, none waiting behind it: no
        # next head to choose for them.
        self.fresh: frozenset[tuple[str, str]] = frozenset()
        self.route_failed = False
        # Of the event rows the recording marked processed, those that matched no endpoint.
        self.unrouted = 0
        # Filled when recorded: the attempts decided in the batch, and how many deliveries
        # of ordered streams became due.
        self.done: list[tuple[Send, AttemptResult, Decision]] = []
        self.promoted = 0
        # Ordered streams whose lock another transaction held when the batch chose their
        # next heads: chosen again after its commit (Dispatcher.promote_busy).
        self.busy: list[tuple[str, str]] = []

    async def run(self, conn: psycopg.AsyncConnection[Any]) -> tuple[int, int | None]:
        """Returns (rows claimed, ms until the next future due row: asked only when the
        claim found nothing, else 0)."""
        try:
            return await self._run(conn)
        finally:
            self.d.commit_ended(self)

    async def _run(self, conn: psycopg.AsyncConnection[Any]) -> tuple[int, int | None]:
        settings = self.d.settings
        async with conn.transaction():
            since = self.d.claim_since
            after = self.resume.position()
            rows = await claim_due(conn, settings.batch_size, since=since, after=after)
            self.resume.front.advance(after, rows, settings.batch_size)
            self.claimed = len(rows)
            self.parts = {row.id: row.partition_at for row in rows}
            if rows:
                await self._plan(conn, await self._route(conn, rows))
                await self._send()
                self.d.show_in_flight()
                await self.d.recorder.record(conn, self)
            # Asked only when the claim from the start found nothing: a loop that claimed
            # rows claims again at once (Dispatcher._claim_loop), and a resumed claim that
            # came back empty looked only after its position, so the next claim, from the
            # start, goes at once (0) rather than after a poll.
            next_due = await next_due_in_ms(conn, since=since) if not rows and after is None else 0
            if rows:
                self.d.commit_started(self)  # the block's end: COMMIT follows
        # Only once committed: a batch rolled back leaves its rows before the position.
        self.resume.claimed(rows, settings.batch_size)
        self.d.after_commit(self)
        self.d.promote_busy(self.busy)
        return len(rows), next_due

    # -- planning ---------------------------------------------------------------------

    async def _route(
        self, conn: psycopg.AsyncConnection[Any], rows: Sequence[Claimed]
    ) -> Sequence[Claimed]:
        """Route the claimed event rows now, before the requests, and return the rows to
        plan: the claimed ones and up to :meth:`_routed_cap` of the deliveries just routed
        that are due now. They are sent in this transaction rather than claimed in a next
        one: one transaction per event instead of two (the fan-out's commit-to-receipt
        time). The event rows of tenants with no endpoint known here are routed by the
        completion statement instead, which costs them no statement of their own; an
        endpoint created a moment ago gets them all the same (the claim saw it:
        ``routable``). Those of a tenant with no endpoint of its own at the claim (a
        single-consumer outbox's, all of them) are not routed at all: the completion
        leaves its routing part out."""
        early: dict[int, datetime | None] = {}
        default = await self._default_registered(conn, rows)
        for row in rows:
            if not row.is_event:
                continue
            self.events.append(row.id)
            if default and row.tenant == "":
                self.for_default.add(row.id)
            if self.d.targets.routes_tenant(row.tenant):
                early[row.id] = row.partition_at
            elif row.routable:
                self.route.append(row.id)
        if not early:
            return rows
        try:
            size = self.d.settings.batch_size
            heads = size if self.d.targets.has_ordered else 0
            # The ordered streams of these events whose delivery may be due at once (their
            # lock, taken without waiting, held to the commit; see route_events). Not a
            # stream with several events here: a burst of one stream's events goes to
            # several batches at once, and the lock, held through the batch, would only
            # make the others wait for it (their deliveries wait for the first anyway).
            # Nor an endpoint that is disabled, or slow or suspected of hanging (its requests
            # leave their batch at once): its request would likely outlive the batch,
            # and a delivery the batch itself wrote has no row left to lease should the
            # batch roll back, so the stream's next delivery could go while it still runs.
            pairs: set[tuple[str, str]] = set()
            if heads:
                mine = [row for row in rows if row.id in early]
                count = Counter((row.tenant, row.stream_id) for row in mine)
                pairs = {
                    (target.id, row.stream_id)
                    for row in mine
                    if count[row.tenant, row.stream_id] == 1
                    for target in self.d.targets.ordered_of(row.tenant)
                    if target.enabled and not target.load.detached_at_once
                }
            locked = await try_lock_streams(conn, pairs) if pairs else set()
            routing = await route_events(
                conn,
                early,
                cap=self._routed_cap(size),
                heads=heads,
                claimed=[row.id for row in rows if row.stream_seq is not None] if heads else (),
                since=self.d.claim_since,
                locked=locked,
            )
        except psycopg.Error:
            # Rejected: the event rows are routed again one by one (Dispatcher._run_batch).
            self.route_failed = True
            raise
        self.prerouted = routing.events
        self.routed_ordered = routing.ordered
        self.fresh = routing.fresh
        for row in routing.due:
            self.parts[row.id] = row.partition_at
        return [*rows, *routing.due]

    async def _default_registered(
        self, conn: psycopg.AsyncConnection[Any], rows: Sequence[Claimed]
    ) -> bool:
        """Whether the default tenant's events are the built-in default endpoint's
        deliveries: it is configured here (WEBHOOK_URL), or, for a dispatcher without it,
        the registry has it (another dispatcher's). Such an event is never marked routed
        by a dispatcher that cannot send it: it becomes the endpoint's delivery and waits
        for one that can (:meth:`_plan_one`). Asked of the registry only for a batch with
        such events, once."""
        if self.d.targets.has_default:
            return True
        if not any(row.is_event and row.tenant == "" for row in rows):
            return False
        found = await conn.execute("SELECT 1 FROM webhook_endpoints WHERE id = %s", (DEFAULT_ID,))
        return await found.fetchone() is not None

    def _routed_cap(self, size: int) -> int:
        """How many of the deliveries it routes the batch sends itself: a batch, and more
        (up to ROUTED_IN_BATCH) while the process has that many connections to spare
        beyond the batch's own rows, so that the extra requests never wait for one."""
        spare = self.d.settings.max_connections - self.d.connections_used() - size
        return max(size, min(ROUTED_IN_BATCH, spare))

    async def _plan(self, conn: psycopg.AsyncConnection[Any], rows: Sequence[Claimed]) -> None:
        candidates: list[tuple[Claimed, Target]] = []
        queued: set[int] = set()  # rows that will wait in this process for a slot
        try:
            for row in rows:
                target = await self._plan_one(conn, row)
                if target is None:
                    continue
                if self.d.egress.since is not None and target.url.startswith("https:"):
                    held = self.d.egress.wait_ms()  # the proxy fails: one probe at a time
                    if held is not None:
                        self.completions.append(deferral(row, held, EGRESS_HELD))
                        self.d.egress.remember(row.id, row.partition_at)
                        continue
                wait = self.d.capacity_wait_s(target)
                queue = wait is not None and self.d.may_wait_for_slot(target)
                if wait is not None and not queue:
                    self.completions.append(deferral(row, int(wait * 1000)))
                    if target.load.slow:
                        self.d.deferred_slow(target, row.id, row.partition_at)
                    continue
                if queue:
                    queued.add(row.id)
                else:
                    target.load.in_flight += 1  # reserved now: later rows of this batch see it
                candidates.append((row, target))
            admissions = await self.d.admit(candidates)
        except BaseException:
            # No request was made of them: give their slots back (the batch rolls back and
            # its rows are claimed again). A slot kept would be lost to the endpoint for
            # the life of the process.
            for row, target in candidates:
                if row.id not in queued:
                    target.load.release()
            raise
        for (row, target), admission in zip(candidates, admissions, strict=True):
            if admission.allowed:
                self.sends.append(Send(row, target, admission, queued=row.id in queued))
                continue
            if row.id not in queued:
                target.load.release()
            self.completions.append(deferral(row, admission.delay_ms))

    async def _plan_one(self, conn: psycopg.AsyncConnection[Any], row: Claimed) -> Target | None:
        """The enabled endpoint to send ``row`` to; None when the row's completion is
        decided without a request (routed, parked, deferred, dead-lettered)."""
        if row.is_event:
            # The built-in default endpoint is the default tenant's (every event type).
            if row.id not in self.for_default:
                self.completions.append(Completion(row.id, Outcome.ROUTED))
                return None
            default = self.d.targets.get(DEFAULT_ID)
            if default is None:
                # Another dispatcher's (the registry has it, this one has no WEBHOOK_URL):
                # the event becomes its delivery and waits for a dispatcher that can send.
                self.d.warn_unconfigured(DEFAULT_ID)
                self.completions.append(
                    Completion(
                        row.id,
                        Outcome.DEFERRED,
                        delay_ms=UNKNOWN_ENDPOINT_DEFER_MS,
                        endpoint_id=DEFAULT_ID,
                    )
                )
                return None
            target = default
        else:
            found = await self._target(conn, row)
            if found is None:
                return None
            if found.tenant != row.tenant:
                # A delivery row naming another tenant's endpoint (written by SQL past
                # every check: the fan-out only ever writes the event's own tenant's): never
                # sent across tenants.
                self._refuse(row, f"endpoint {found.id} is not an endpoint of the row's tenant")
                return None
            target = found
        if not target.enabled:
            # The cache may be a moment behind an enable (its NOTIFY is on its way):
            # the registry decides before a row is parked.
            target = await self.d.targets.reload(conn, target.id) or target
        if not target.enabled:
            endpoint_id = recorded_endpoint(row)
            self.completions.append(Completion(row.id, Outcome.PARKED, endpoint_id=endpoint_id))
            return None
        return target

    def _refuse(self, row: Claimed, error: str) -> None:
        """``row`` is a dead letter without a request (``invalid_request``, naming why)."""
        self.completions.append(
            Completion(row.id, Outcome.DEAD_LETTER, error=error, reason="invalid_request")
        )

    async def _target(self, conn: psycopg.AsyncConnection[Any], row: Claimed) -> Target | None:
        """The row's endpoint. Unknown here: reloaded from the registry; an endpoint gone
        from it was removed (its delivery becomes a dead letter, as removal promises), and
        so is one whose row cannot be used (its reason named); a built-in endpoint this
        dispatcher is not configured for waits."""
        assert row.endpoint_id is not None
        target = self.d.targets.get(row.endpoint_id)
        if target is not None:
            return target
        # Read again once per batch (a row found unusable may have been fixed a moment
        # ago, its notification not yet heard): a dead letter is never made on a stale
        # reading, nor the row read again for each of its deliveries.
        if row.endpoint_id not in self.reread:
            self.reread.add(row.endpoint_id)
            target = await self.d.targets.reload(conn, row.endpoint_id)
            if target is not None:
                return target
        problem = self.d.targets.unusable(row.endpoint_id)
        if problem is not None:
            self._refuse(row, f"endpoint {row.endpoint_id} cannot be used: {problem}")
            return None
        if row.endpoint_id in (DEFAULT_ID, "operator"):
            self.d.warn_unconfigured(row.endpoint_id)
            self.completions.append(
                Completion(row.id, Outcome.DEFERRED, delay_ms=UNKNOWN_ENDPOINT_DEFER_MS)
            )
            return None
        exists = await conn.execute(
            "SELECT 1 FROM webhook_endpoints WHERE id = %s", (row.endpoint_id,)
        )
        # A built-in of another configuration, or an endpoint whose encrypted secret no
        # key of this process opens (Targets.locked): it waits for a dispatcher that can.
        if await exists.fetchone() is not None:
            # Said where the delivery is read (its wait_reason): a dispatcher without the
            # key showed only "pending" to everyone but its own log.
            locked = self.d.targets.locked(row.endpoint_id) is not None
            self.completions.append(
                Completion(
                    row.id,
                    Outcome.DEFERRED,
                    delay_ms=UNKNOWN_ENDPOINT_DEFER_MS,
                    error=LOCKED_WAIT if locked else None,
                )
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
            at_once = send.target.load.detached_at_once
            if at_once and self._share_full(send):
                continue
            send.task = asyncio.create_task(self.d.send(send))
            if at_once:
                self._detach(send)
            else:
                inline.append(send)
        if inline:
            await self._wait(inline)
        for send in inline:
            assert send.task is not None
            if not send.task.done():
                if send.started:  # a request that outlived the batch, not a wait for a slot
                    self._mark_slow_if_it_lasts(send)
                # Detached even past the share: a request on the wire is never given up
                # (its consumer may be working on it: it would have it twice).
                self._detach(send)

    @staticmethod
    def _mark_slow_if_it_lasts(send: Send) -> None:
        """A straggler's endpoint is suspect at once (its requests leave their batches at
        once), and slow once a request to it has run PATIENCE_S (now, or later if it still
        runs then): one early straggler is not enough to defer its rows by timeouts, it
        may be a healthy endpoint's request that lost a moment to a busy machine."""
        load = send.target.load
        load.mark_suspect()
        left = PATIENCE_S - (time.monotonic() - send.started_at)
        if left <= 0:
            load.mark_slow()
            return

        def check() -> None:
            if send.task is not None and not send.task.done():
                load.mark_slow()

        asyncio.get_running_loop().call_later(left, check)

    def _share_full(self, send: Send) -> bool:
        """Whether the requests detached from their batches hold their whole share of
        the process's connections; if so, ``send`` (to an endpoint whose requests leave
        their batch at once) is not sent: its row is deferred until the first of them
        ends, spread."""
        wait = self.d.slow_share_wait_s(send.target)
        if wait is None:
            return False
        send.withheld = True
        if not send.queued:
            send.target.load.release()  # reserved by the plan, never sent
        self.completions.append(deferral(send.row, int(wait * 1000)))
        self.d.deferred_slow(send.target, send.row.id, send.row.partition_at)
        metrics.SHARE_DEFERRED.inc()
        return True

    async def _wait(self, inline: Sequence[Send]) -> None:
        """Wait for the batch's requests, at most PATIENCE_S. Once every endpoint still
        being waited for is one that has not answered any request of this batch while
        others have, those stragglers get STRAGGLER_FACTOR times as long as the batch
        has taken so far (at least STRAGGLER_MIN_S) before they are detached: a consumer
        that hangs, seen for the first time, then costs its batch a few milliseconds,
        not the whole patience (the next ones are detached at once: it is suspect now)."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + PATIENCE_S
        by_task: dict[asyncio.Future[AttemptResult], Send] = {
            send.task: send for send in inline if send.task is not None
        }
        pending: set[asyncio.Future[AttemptResult]] = set(by_task)
        answered: set[str] = set()
        cut = False
        while pending:
            timeout = deadline - loop.time()
            if timeout <= 0:
                return
            done, pending = await asyncio.wait(
                pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
            answered.update(by_task[task].endpoint_id for task in done)
            if (
                not cut
                and pending
                and answered
                and not any(by_task[task].endpoint_id in answered for task in pending)
            ):
                cut = True
                now = loop.time()
                grace = max(STRAGGLER_MIN_S, STRAGGLER_FACTOR * (now - start))
                deadline = min(deadline, now + grace)

    def _detach(self, send: Send) -> None:
        """Let the request outlive the batch: the row is leased (due again only after the
        request's timeout and a margin) and the Completer records its outcome."""
        send.lease = uuid.uuid4()
        send.committed = asyncio.Event()
        self.d.completer.detached(send)
        self.completions.append(
            Completion(
                send.row.id,
                Outcome.LEASED,
                delay_ms=self.d.settings.timeout_ms + LEASE_GRACE_MS,
                endpoint_id=recorded_endpoint(send.row),
                lease=send.lease,
            )
        )
        metrics.DETACHED.inc()

    def finished(self) -> list[tuple[Send, AttemptResult]]:
        """The sends whose request ended within the batch."""
        out = []
        for send in self.sends:
            if send.lease is None and not send.withheld:
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
    """The completion of one attempt. A 410 Gone from a registered endpoint is recorded as
    any failed attempt, with a next attempt even past ``WEBHOOK_MAX_ATTEMPTS`` by one
    (reason ``gone``): its endpoint is disabled in the same transaction
    (:func:`apply_effects`), which parks that next attempt with the endpoint's other
    deliveries. Should the database refuse the disable, the next attempt is due after the
    retry schedule's delay instead of waiting parked on an enabled endpoint, and a 410 to
    that extra attempt is decided as any failure (a dead letter)."""
    row = send.row
    endpoint_id = recorded_endpoint(row)
    if result.reason in HELD:
        # The egress proxy or the DNS resolver failed, no consumer was asked: the row is
        # held (egress.py) with its attempt unused, and its endpoint's failure streak
        # neither starts nor ends (effects_of), nor does its breaker hear of it
        # (breaker_signal). Such an outage disables no endpoint, opens no breaker and
        # dead-letters nothing. (The resolver's hold was begun by the lookups that showed
        # it: a request that failed before an answer ended it begins none again.)
        if result.reason == EGRESS:
            hold, delay_ms = dispatcher.egress, dispatcher.egress.failed()
        else:
            hold = dispatcher.resolving.hold
            delay_ms = hold.held_ms()
        decision = Decision(Outcome.DEFERRED, delay_ms=delay_ms, reason=result.reason)
        hold.remember(row.id, row.partition_at)
        dispatcher.log_decision(row, send.target, result, decision)
        held = Completion(
            row.id, Outcome.DEFERRED, delay_ms=decision.delay_ms, error=HELD[result.reason],
            endpoint_id=endpoint_id, lease=lease,
        )  # fmt: skip
        return held, decision
    if gone_retried(dispatcher.policy, row, send.target, result):
        decision = Decision(
            Outcome.RETRY, delay_ms=dispatcher.policy.delay_ms(row.attempt), reason="gone"
        )
    else:
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


def gone(target: Target, result: AttemptResult) -> bool:
    """A 410 Gone from a registered endpoint: it is disabled at once (the built-in ones
    keep the first wave's rule: a 410 is a dead letter)."""
    return result.status == GONE and not target.builtin


def gone_retried(policy: RetryPolicy, row: Claimed, target: Target, result: AttemptResult) -> bool:
    """A 410 recorded with a next attempt (:func:`outcome_of`): allowed once past the
    attempts of ``WEBHOOK_MAX_ATTEMPTS``."""
    return gone(target, result) and row.attempt <= policy.max_attempts


def effects_of(done: Sequence[tuple[Send, AttemptResult, Decision]]) -> Effects:
    effects = Effects(set(), set(), [], set())
    for send, result, decision in done:
        if decision.outcome is Outcome.DEFERRED:  # held at the egress: says nothing of it
            continue
        endpoint = send.target.id
        if result.kind is Kind.DELIVERED:
            effects.succeeded.add(endpoint)
        else:
            effects.failed.add(endpoint)
        if gone(send.target, result):
            effects.gone.add(endpoint)
        if send.row.stream_seq is not None and decision.outcome in (
            Outcome.DELIVERED,
            Outcome.DEAD_LETTER,
        ):
            effects.ordered.append((endpoint, send.row.stream_id))
    return effects


async def promote_trying(
    conn: psycopg.AsyncConnection[Any],
    pairs: Sequence[tuple[str, str]],
    busy: list[tuple[str, str]],
) -> int:
    """The next heads of the ordered streams ``pairs`` in a dispatcher's transaction, which
    never waits for a stream's lock (migration 0011): those held elsewhere are added to
    ``busy``, to choose after the commit (Dispatcher.promote_busy). Returns how many
    deliveries became due."""
    promoted, held = await try_promote_heads(conn, pairs)
    busy.extend(held)
    return promoted


async def apply_effects(
    dispatcher: Dispatcher,
    conn: psycopg.AsyncConnection[Any],
    recorded: Recorded,
    effects: Effects,
    busy: list[tuple[str, str]],
) -> int:
    """In the recording transaction, after its statement: the next heads of ordered
    streams (``busy``: see :func:`promote_trying`), and endpoints disabled (410 Gone at
    once; failing for longer than ``WEBHOOK_DISABLE_AFTER``). Returns how many deliveries
    became due."""
    for endpoint_id in sorted(effects.gone):
        await _disable(dispatcher, conn, endpoint_id, "gone")
    after = dispatcher.settings.disable_after_ms
    candidates = sorted(effects.failed - effects.succeeded - effects.gone)
    if after and candidates:
        cur = await conn.execute(
            "SELECT id FROM webhook_endpoints WHERE id = ANY(%s) AND state = 'enabled'"
            " AND id NOT IN ('operator', 'default') AND failing_since <= clock_timestamp()"
            " - %s * interval '1 millisecond'",
            (candidates, after),
        )
        for (endpoint_id,) in await cur.fetchall():
            await _disable(dispatcher, conn, str(endpoint_id), "failing")
    return await promote_trying(conn, [*recorded.ordered, *effects.ordered], busy)


async def _disable(
    dispatcher: Dispatcher, conn: psycopg.AsyncConnection[Any], endpoint_id: str, reason: str
) -> None:
    """Disable one endpoint under a savepoint of its own: one the database refuses to
    disable (or removed meanwhile) is logged and left as it is, without undoing the others
    or the ordered streams' next heads chosen after. A later failure tries again; the next
    attempt of a delivery that got a 410 is then due on the retry schedule (outcome_of)."""
    from . import endpoints

    try:
        async with conn.transaction():
            # The recording lifted the session's lock and statement timeouts for the
            # commit (complete_batch); the wait for the endpoint's row stays bounded, and
            # the commit's unbounded again after it (rolling the savepoint back restores).
            bounds = (str(DISABLE_LOCK_TIMEOUT_MS), str(STATEMENT_TIMEOUT_MS))
            await conn.execute(_BOUNDED_WAITS, bounds)
            _, changed = await endpoints.disable_once(conn, endpoint_id, reason=reason)
            await conn.execute(_BOUNDED_WAITS, ("0", "0"))
    except SAVEPOINT_ONLY_ERRORS as exc:
        # A deadlock with, or a lock or statement timeout behind, another transaction
        # that holds the endpoint's row (an operator's enable, an API edit): only the
        # savepoint is undone, the batch's recordings stand. Re-raising would roll the
        # batch back and send its deliveries again, as often as the other transaction
        # keeps the row.
        log.error("endpoint %s: disabling it failed (%s)", endpoint_id, type(exc).__name__)
        return
    except (psycopg.Error, NotFoundError) as exc:
        if outage(exc):
            raise
        log.error("endpoint %s: disabling it failed (%s)", endpoint_id, type(exc).__name__)
        return
    if changed:  # not when another batch's 410 disabled it a moment before
        dispatcher.note_disabled(endpoint_id, reason)


def breaker_signal(result: AttemptResult) -> Signal:
    """What the attempt says of its consumer (:data:`~fluxora_webhooks.gate.Signal`)."""
    if result.kind is Kind.DELIVERED:
        return True
    if result.kind is Kind.RETRYABLE:
        # Failed at the egress proxy or the resolver: no word of the consumer.
        return None if result.reason in HELD else False
    # A permanent failure: answered (a 4xx, a 3xx) says the consumer is up; refused before
    # any request (the URL policy, a row that cannot be sent) says nothing of it.
    return ANSWERED if result.status is not None else None
