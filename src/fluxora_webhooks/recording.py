"""Recording outcomes: a batch's in its claim transaction, a detached request's later in a
transaction of its own (the :class:`Completer`), both through one statement
(:func:`~fluxora_webhooks.outbox.complete`) and the effects that follow it.

One bad row never undoes the others: when the database rejects a batch's statement, the
rows still ours are recorded one by one (each under a savepoint, falling back to a dead
letter, then to a deferral).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import TYPE_CHECKING, Any

import psycopg

from .batch import (
    Batch,
    Effects,
    Send,
    apply_effects,
    breaker_signal,
    deferral,
    effects_of,
    outage,
    outcome_of,
    promote_trying,
)
from .delivery import AttemptResult
from .endpoints import DEFAULT_ID
from .outbox import Completion, Outcome, Recorded, complete, relock_claimed
from .pgtypes import described
from .retry import Decision

if TYPE_CHECKING:
    from .dispatcher import Dispatcher
    from .gate import Signal
    from .targets import Load

log = logging.getLogger("fluxora_webhooks.dispatcher")

# Outcomes written without a savepoint around the batch's statement (Recorder.record). A
# deferral or a parking only moves the row's due time; a batch with one is the common case
# beside a busy or hanging endpoint, where the savepoint's round trips and subtransaction
# cost the healthy rows of every such batch.
_PLAIN = frozenset({Outcome.DELIVERED, Outcome.ROUTED, Outcome.DEFERRED, Outcome.PARKED})


class Recorder:
    """Writes outcomes for a dispatcher."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.d = dispatcher

    async def record(self, conn: psycopg.AsyncConnection[Any], batch: Batch) -> None:
        """A batch's outcomes, in its claim transaction.

        A batch where every row was delivered, routed, deferred or parked is written
        without a savepoint: SAVEPOINT and RELEASE cost two more round trips and a subtransaction,
        about a fifth of the database's CPU per batch (docs/performance.md); if it fails,
        the transaction rolls back and the batch is recorded again row by row. A batch that
        inserts retries or dead letters gets a savepoint, so a row the database rejects is
        recorded on its own while the others keep their locks."""
        done: list[tuple[Send, AttemptResult, Decision]] = []
        for send, result in batch.finished():
            completion, decision = outcome_of(self.d, send, result)
            batch.completions.append(completion)
            done.append((send, result, decision))
        batch.done = done
        effects = effects_of(done)
        if batch.fresh:
            effects.ordered = [p for p in effects.ordered if p not in batch.fresh]
        route, prerouted = batch.route, batch.prerouted
        if all(c.outcome in _PLAIN for c in batch.completions):
            recorded = await complete(
                conn, batch.completions, batch.parts, route=route, prerouted=prerouted,
                **_streaks(effects),
            )  # fmt: skip
        else:
            try:
                async with conn.transaction():
                    recorded = await complete(
                        conn, batch.completions, batch.parts, route=route, prerouted=prerouted,
                        **_streaks(effects),
                    )  # fmt: skip
            except psycopg.Error as exc:
                if outage(exc):
                    raise
                log.error("batch completion failed (%s); completing row by row", described(exc))
                batch.completions = await self._one_by_one(
                    conn, batch.completions, batch.parts, route=route, prerouted=prerouted
                )
                recorded = Recorded()
        batch.unrouted = recorded.unrouted
        if batch.routed_ordered:
            recorded = replace(recorded, ordered=[*batch.routed_ordered, *recorded.ordered])
        batch.promoted = await self._effects(conn, recorded, effects, batch.busy, in_batch=True)

    async def record_again(
        self, conn: psycopg.AsyncConnection[Any], batch: Batch
    ) -> list[Completion]:
        """After a batch's transaction rolled back on its statement: lock again the rows
        still ours to record and record each on its own. A row another loop claimed
        meanwhile is skipped: that loop sends it again (at-least-once)."""
        completions = batch.completions
        batch.unrouted = 0  # the rolled-back statement's count: its rows are recorded anew
        if batch.route_failed:  # rejected before anything was planned or sent
            # Routed one by one; an event the default endpoint delivers itself becomes that
            # delivery, due at once (marked routed, it would never reach the default).
            completions = [
                Completion(i, Outcome.DEFERRED, endpoint_id=DEFAULT_ID)
                if i in batch.for_default
                else Completion(i, Outcome.ROUTED)
                for i in batch.events
            ]
        busy: list[tuple[str, str]] = []
        async with conn.transaction():
            # The deliveries routed in the rolled-back transaction are gone: its event rows
            # are routed again, each on its own, under the same delivery ids.
            mine = await relock_claimed(conn, {c.id: batch.parts[c.id] for c in completions})
            kept = [c for c in completions if c.id in mine]
            # The ordered streams whose head the batch sent and decided (delivered, dead):
            # their next heads, with those of the events routed again below.
            ordered = effects_of([d for d in batch.done if d[0].row.id in mine]).ordered
            recorded = await self._one_by_one(
                conn,
                kept,
                batch.parts,
                route=[i for i in batch.events if i in mine],
                ordered=ordered,
            )
            # The recorded ordered streams' next heads (the sweep, should this fail).
            await self._effects(
                conn, Recorded(ordered=ordered), Effects(set(), set(), [], set()), busy
            )
        self.d.promote_busy(busy)
        return recorded

    def prepare_detached(self, items: Sequence[Detached]) -> Prepared:
        """Decide the outcomes of requests that outlived their batch (once: the write may
        be tried again)."""
        done: list[tuple[Send, AttemptResult, Decision]] = []
        completions = []
        for item in items:
            if item.result is None:  # not sent: due again at once, while it holds its lease
                completions.append(replace(deferral(item.send.row, 1), lease=item.send.lease))
                continue
            completion, decision = outcome_of(self.d, item.send, item.result, lease=item.send.lease)
            completions.append(completion)
            done.append((item.send, item.result, decision))
        parts = {item.send.row.id: item.send.row.partition_at for item in items}
        return Prepared(completions, [d for _, _, d in done], effects_of(done), parts)

    async def record_detached(self, conn: psycopg.AsyncConnection[Any], prepared: Prepared) -> None:
        """Write them, each under its lease: a row whose lease is gone (its dispatcher was
        presumed dead and another sent it again) is left to that other attempt."""
        busy: list[tuple[str, str]] = []
        async with conn.transaction():
            recorded = await complete(
                conn, prepared.completions, prepared.parts, **_streaks(prepared.effects)
            )
            await self._effects(conn, recorded, prepared.effects, busy)
        self.d.promote_busy(busy)

    async def _effects(
        self,
        conn: psycopg.AsyncConnection[Any],
        recorded: Recorded,
        effects: Effects,
        busy: list[tuple[str, str]],
        *,
        in_batch: bool = False,
    ) -> int:
        """The ordered streams' next heads and the endpoints to disable, after a
        recording's statement (``busy``: see :func:`~fluxora_webhooks.batch.promote_trying`)."""
        if not (recorded.ordered or effects.ordered or effects.gone or effects.failed):
            return 0
        if in_batch and not (effects.gone or effects.failed):
            # Only ordered streams' next heads, in a batch's claim transaction: no savepoint
            # (two round trips and a subtransaction on every batch to an ordered endpoint).
            # Should the promotion fail, the transaction rolls back and the batch is
            # recorded again row by row (Dispatcher._run_batch); the sweep chooses those
            # heads. Detached requests' outcomes keep the savepoint: nothing records them
            # again row by row, and they must stand.
            return await promote_trying(conn, [*recorded.ordered, *effects.ordered], busy)
        try:
            async with conn.transaction():
                return await apply_effects(self.d, conn, recorded, effects, busy)
        except psycopg.Error as exc:
            if outage(exc):
                raise
            # The outcomes stand; a stream whose next head was not chosen is found by the
            # periodic sweep, an endpoint not disabled by its next failure.
            log.error("after recording: %s (%s)", type(exc).__name__, exc.sqlstate)
            return 0

    async def _one_by_one(
        self,
        conn: psycopg.AsyncConnection[Any],
        completions: Sequence[Completion],
        parts: Mapping[int, datetime | None],
        *,
        route: Sequence[int] = (),
        prerouted: Collection[int] = (),
        ordered: list[tuple[str, str]] | None = None,
    ) -> list[Completion]:
        """Each of ``completions`` on its own (:meth:`_complete_one`); the ordered streams
        whose next head may now be chosen are added to ``ordered``."""
        recorded = []
        for one in completions:
            done = await self._complete_one(
                conn, one, parts, [one.id] if one.id in route else [], prerouted, ordered
            )
            if done is not None:
                recorded.append(done)
        return recorded

    async def _complete_one(
        self,
        conn: psycopg.AsyncConnection[Any],
        one: Completion,
        parts: Mapping[int, datetime | None],
        route: list[int],
        prerouted: Collection[int],
        ordered: list[tuple[str, str]] | None = None,
    ) -> Completion | None:
        """Record one row's outcome (routing it if it is in ``route``); failing that,
        dead-letter it; failing that, defer it a minute (never left due at once: that would
        re-send it in a tight loop). An event row tries all three with its routing first
        (what failed may be its own outcome's write: its fan-out must not be lost to it),
        then the last two without (what failed may be the fan-out itself: rejected again
        on every claim, it would never end). Returns what was recorded (None: nothing
        could be; the row stays pending)."""
        said = getattr(one.outcome, "value", one.outcome)
        rejected = f"could not record outcome {said!r}: database rejected the row"
        dead = Completion(
            one.id,
            Outcome.DEAD_LETTER,
            status_code=one.status_code,
            error=rejected,
            reason="internal_error",
            endpoint_id=one.endpoint_id,
            lease=one.lease,
        )

        def later(routed: bool) -> Completion:
            # An event row whose fan-out is written (now or earlier in the batch) and that
            # the default endpoint delivers becomes that delivery, due later; one whose
            # fan-out is not written stays an event row, to be routed when it is due.
            endpoint_id = one.endpoint_id if routed else None
            return Completion(
                one.id, Outcome.DEFERRED, delay_ms=60_000, endpoint_id=endpoint_id, lease=one.lease
            )

        written = one.id in prerouted
        # None: the dead letter, naming what the database said last (an index entry too
        # large names its index).
        tries: list[tuple[Completion | None, list[int]]] = [
            (one, route),
            (None, route),
            (later(bool(route) or written), route),
        ]
        if route:
            tries += [(None, []), (later(written), [])]
        for candidate, routing in tries:
            recording = candidate or dead
            try:
                async with conn.transaction():
                    done = await complete(
                        conn, [recording], parts, route=routing, prerouted=prerouted
                    )
                if ordered is not None:
                    ordered.extend(done.ordered)
                return recording
            except psycopg.Error as exc:
                if outage(exc):
                    raise
                log.error(
                    "row %d: recording %s failed (%s, %s)",
                    one.id,
                    recording.outcome,
                    exc.sqlstate,
                    described(exc),
                )
                said = (exc.diag.message_primary or type(exc).__name__)[:200]
                dead = replace(dead, error=f"{rejected} ({exc.sqlstate}: {said})")
        log.error("row %d: could not be completed at all; it stays pending", one.id)
        return None


def _streaks(effects: Effects) -> dict[str, Any]:
    return {"succeeded": sorted(effects.succeeded), "failed": sorted(effects.failed)}


@dataclass
class Prepared:
    """Detached attempts' outcomes, decided, to write."""

    completions: list[Completion]
    decisions: list[Decision]
    effects: Effects
    parts: dict[int, datetime | None]


@dataclass
class Detached:
    """A request that outlived its batch, done now; or (``result`` None) one never sent,
    its row to put back due at once."""

    send: Send
    result: AttemptResult | None


class Completer:
    """Records the requests that outlived their batch, a few at a time, in transactions of
    its own (a connection of the dispatcher's pool)."""

    # Gather what ends within this long into one transaction.
    LINGER_S = 0.005
    MAX_GROUP = 200

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.d = dispatcher
        self._queue: asyncio.Queue[Detached] = asyncio.Queue()
        # Detached requests not settled yet (in flight, or waiting to be recorded), each
        # with the moment its request ends at the latest (its timeout, from its detach).
        self._ends: dict[Send, float] = {}
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def outstanding(self) -> int:
        return len(self._ends)

    def detached(self, send: Send) -> None:
        """A request was detached from its batch: it is the completer's until settled."""
        self._ends[send] = time.monotonic() + self.d.settings.timeout_ms / 1000
        self._idle.clear()

    def next_end_in_s(self, timeout_s: float) -> float:
        """How long until the first detached request is expected to end (0: none): one
        that has started after its endpoint's request time (Load.expected_end), one still
        waiting for a slot at the latest by its deadline."""
        if not self._ends:
            return 0.0
        first = min(
            send.target.load.expected_end(send.started_at, timeout_s) if send.started else end
            for send, end in self._ends.items()
        )
        return max(0.0, first - time.monotonic())

    def unanswered(self) -> Load | None:
        """An endpoint whose detached request's end is guessed at its timeout for want of
        an answer: it has answered none yet (next_end_in_s knows no better until its first
        answer). None when every detached request's end is estimated from answers."""
        for send in self._ends:
            if send.started and send.target.load.typical_s <= 0.0:
                return send.target.load
        return None

    def submit(self, send: Send, result: AttemptResult | None) -> None:
        """A detached request's outcome to record (None: it was not sent, its row is put
        back due at once)."""
        self._queue.put_nowait(Detached(send, result))

    def settled(self, sends: Sequence[Send]) -> None:
        """Recorded, or given up (its row is sent again when its lease ends)."""
        for send in sends:
            self._ends.pop(send, None)
        if not self._ends:
            self._idle.set()

    async def run(self) -> None:
        """Until cancelled; on the way out, records what is already queued."""
        while True:
            first = await self._queue.get()
            group = [first]
            await asyncio.sleep(self.LINGER_S)
            while not self._queue.empty() and len(group) < self.MAX_GROUP:
                group.append(self._queue.get_nowait())
            await self._write(group)

    async def drain(self, timeout_s: float) -> None:
        """Wait (bounded) for the detached requests to end and be recorded."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            # Their rows are leased: sent again once the lease ends (at-least-once).
            log.warning(
                "%d detached request(s) not recorded within %.1fs of the stop;"
                " their rows are sent again once their lease ends",
                len(self._ends),
                timeout_s,
            )

    async def _write(self, group: list[Detached]) -> None:
        prepared = self.d.recorder.prepare_detached(group)
        backoff = 0.05
        deadline = asyncio.get_running_loop().time() + self.d.settings.timeout_ms / 1000
        while True:
            try:
                await self.d.with_connection(
                    lambda conn: self.d.recorder.record_detached(conn, prepared)
                )
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if asyncio.get_running_loop().time() > deadline:
                    # The leases end soon: those rows are sent again (at-least-once).
                    log.error(
                        "could not record %d detached attempt(s) (%s); they will be sent again",
                        len(group),
                        type(exc).__name__,
                    )
                    self.settled([item.send for item in group])
                    return
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
        self.settled([item.send for item in group])
        for decision in prepared.decisions:
            self.d.count(decision.outcome, decision.reason)
        reports: dict[str, list[tuple[Any, Signal]]] = {}
        for item in group:
            if item.result is not None:
                reports.setdefault(item.send.target.url, []).append(
                    (item.send.admission, breaker_signal(item.result))
                )
        self.d.report_later(reports)
