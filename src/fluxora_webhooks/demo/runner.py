"""The demo's wiring: the cast registered, one dispatcher, the steps one after another, and
the checks of each (:mod:`.checks`).

One process, one event loop: writers (the application), the dispatcher (with the Redis
gate), one consumer per endpoint and the operator's consumer. Each step changes one thing
(an endpoint goes down, comes back, rejects, a stream's head retries), writes its share of
stream events, waits until what it shows has happened (or the run's timeout), and checks it.

1. Fan-out: every event reaches each endpoint of its tenant that subscribes to it.
2. Isolation and auto-disable: acme/ledger hangs; the others keep receiving; ledger is
   disabled after ``WEBHOOK_DISABLE_AFTER``, its deliveries parked; the operator is told.
3. Re-enable: ledger answers again and is enabled; its parked deliveries are delivered.
4. Recovery: initech/billing rejects every second request for a while (dead letters);
   ``recover`` re-queues them and they are delivered with their delivery ids.
5. Ordering: globex/sync is ordered; one stream's head is refused three times while the
   other streams flow.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg

from .. import endpoints
from ..dispatcher import Dispatcher
from ..errors import FluxoraError
from ..gate import DeliveryGate
from ..migrations import migrate
from ..redis_gate import gate_for
from ..settings import Settings
from . import checks, streams
from .cast import BILLING, GLOBEX, LEDGER, PARTS, SYNC, TENANTS, Part
from .checks import Check
from .consumer import Consumer
from .streams import OWNED, STREAM_PREFIX, Committed, Ledger, Write

# Arbitrary but fixed: the advisory lock a running demo holds on its database.
DEMO_LOCK_KEY = 0x666C7864656D6F
_LOCK_WAIT_S = 10.0
_TICK_S = 0.1
# After a step's last delivery: how long to keep listening for anything that should not come.
_QUIET_S = 0.3
_STOP_S = 15.0
_LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))
# The share of --events each writing step writes (fan-out, outage, recovery).
_SHARES = (0.4, 0.3, 0.3)
# The ordering step: new streams of globex, each created then updated, at this pace.
_BURST_STREAMS, _BURST_UPDATES, _BURST_RATE = 3, 4, 30.0
_HOLD_TIMES = 3

STEPS = (
    "Fan-out",
    "Isolation and auto-disable",
    "Re-enable",
    "Recovery",
    "Per-stream ordering",
)


class DemoError(FluxoraError):
    """The demo cannot run here (its database is in use, or holds others' events)."""


@dataclass(frozen=True)
class DemoOptions:
    events: int = 300
    seed: int = 1
    rate: float = 150.0  # stream writes per second; 0: as fast as possible
    writers: int = 4
    timeout_s: float = 90.0
    retry_delay_ms: int = 200
    retry_rps: int = 25  # the Redis rate limit of retries, per consumer
    request_timeout_ms: int = 2000  # WEBHOOK_TIMEOUT_MS: how long a hung request is given
    disable_after_ms: int = 1000  # WEBHOOK_DISABLE_AFTER (its lowest value)
    redis_prefix: str = ""


@dataclass(frozen=True)
class Progress:
    """Where the current step is, for the display."""

    step: int
    written: int
    planned: int
    delivered: int
    expected: int
    note: str
    elapsed_s: float


@dataclass
class StepReport:
    number: int
    title: str
    checks: list[Check] = field(default_factory=list)
    shown: str = ""  # what the step showed, in one line of figures


@dataclass(frozen=True)
class PartReport:
    """One endpoint's line of the summary."""

    part: Part
    endpoint_id: str
    delivered: int
    retries: int
    duplicates: int
    note: str


@dataclass
class DemoReport:
    """What happened and what was checked (``ok``: every check held, nothing went wrong)."""

    options: DemoOptions
    steps: list[StepReport] = field(default_factory=list)
    parts: list[PartReport] = field(default_factory=list)
    operator_events: int = 0
    committed: int = 0
    rolled_back: int = 0
    deliveries: int = 0
    elapsed_s: float = 0.0
    standard_library: bool = False
    problems: list[str] = field(default_factory=list)

    @property
    def checks(self) -> list[Check]:
        return [c for s in self.steps for c in s.checks]

    @property
    def ok(self) -> bool:
        return not self.problems and bool(self.checks) and all(c.ok for c in self.checks)


class Display:
    """What the runner reports to while it runs (see :mod:`.display`)."""

    def cast(self, parts: Sequence[tuple[Part, str, str]], operator_url: str) -> None: ...

    def step(self, number: int, title: str, text: str) -> None: ...

    def update(self, progress: Progress) -> None: ...

    def checks(self, checks: Sequence[Check]) -> None: ...


async def run_demo(
    options: DemoOptions,
    *,
    database_url: str,
    redis_url: str,
    display: Display | None = None,
) -> DemoReport:
    """Run the demo on these engines; raises :class:`DemoError` when it cannot start."""
    return await _DemoRun(options, database_url, redis_url, display or Display()).run()


class _StepFailed(Exception):
    """A step could not finish (timed out, or the dispatcher or a writer failed)."""


class _DemoRun:
    def __init__(
        self, options: DemoOptions, database_url: str, redis_url: str, display: Display
    ) -> None:
        self.options = options
        self.database_url = database_url
        self.redis_url = redis_url
        self.display = display
        self.ledger = Ledger()
        self.cast = {
            part: Consumer(part.label, "", refuse_every=part.refuse_every, ordered=part.ordered)
            for part in PARTS
        }
        self.operator_secret = endpoints.new_secret()
        self.operator = Consumer("operator", self.operator_secret)
        self.ids: dict[Part, str] = {}
        self.report = DemoReport(options)
        self.notes: dict[Part, str] = {}
        self._started = time.monotonic()
        self._deadline = self._started + options.timeout_s
        self._step = 0
        self._step_events: list[Committed] = []
        self._step_planned = 0
        self._note = ""
        self._written = 0
        self._writers: list[asyncio.Task[None]] = []
        self._shadow: Ledger | None = None
        self._dispatching: asyncio.Task[None] | None = None
        self.before: checks.Percentiles | None = None

    # -- the run ------------------------------------------------------------------------

    async def run(self) -> DemoReport:
        async with await psycopg.AsyncConnection.connect(
            self.database_url, autocommit=True, connect_timeout=10
        ) as admin:
            self.admin = admin
            await migrate(admin)
            await _hold_demo_lock(admin)
            await _refuse_foreign_backlog(admin)
            await streams.prepare(admin)
            consumers = [*self.cast.values(), self.operator]
            for consumer in consumers:
                await consumer.start()
            try:
                await self._register()
                settings = self._settings()
                gate = await gate_for(settings, self.redis_url)
                try:
                    await self._dispatch(settings, gate)
                finally:
                    await gate.close()
            finally:
                for consumer in consumers:
                    await consumer.stop()
            await self._finish()
        return self.report

    async def _register(self) -> None:
        """Each endpoint registered for its tenant, with a secret of its own (generated by
        the registry, shown once: its consumer is given it)."""
        for part, consumer in self.cast.items():
            endpoint, secret = await endpoints.create(
                self.admin,
                url=consumer.url,
                tenant=part.tenant,
                event_types=part.events,
                ordered=part.ordered,
                description=f"fluxora-webhooks demo: {part.role}",
                allowed_networks=_LOOPBACK,
            )
            consumer.use_secret(secret)
            self.ids[part] = endpoint.id
        self.display.cast(
            [(p, self.ids[p], c.url) for p, c in self.cast.items()], self.operator.url
        )

    def _settings(self) -> Settings:
        o = self.options
        return Settings(
            operator_url=self.operator.url,
            operator_secret=self.operator_secret.encode(),
            allowed_networks=_LOOPBACK,  # the demo's consumers listen on loopback
            poll_interval_ms=1000,  # a fallback only: LISTEN/NOTIFY wakes the dispatcher
            batch_size=20,
            claim_loops=4,
            retry_schedule_ms=(o.retry_delay_ms,),
            retry_rps=o.retry_rps,
            max_attempts=8,
            timeout_ms=o.request_timeout_ms,
            disable_after_ms=o.disable_after_ms,
            metrics_port=0,
            # A prefix of its own per run: nothing a killed run left in Redis applies.
            redis_prefix=f"{o.redis_prefix}fluxora-demo:{secrets.token_hex(4)}:",
        )

    async def _dispatch(self, settings: Settings, gate: DeliveryGate) -> None:
        """Start the dispatcher, run the steps; stop it all."""
        dispatcher = Dispatcher(settings, conninfo=self.database_url, gate=gate)
        self._dispatching = asyncio.create_task(dispatcher.run(), name="demo-dispatcher")
        # The dispatcher logs each retry at INFO and the outage at WARNING: the steps show
        # them as counts and checks instead.
        dispatcher_log = logging.getLogger("fluxora_webhooks.dispatcher")
        level = dispatcher_log.level
        dispatcher_log.setLevel(logging.ERROR)
        try:
            await asyncio.wait_for(dispatcher.ready.wait(), 30)
            plan = streams.plan(self.options.events, self.options.seed, TENANTS)
            cuts = _cuts(len(plan))
            steps: list[Callable[[], Awaitable[None]]] = [
                lambda: self._fan_out(plan[: cuts[0]]),
                lambda: self._outage(plan[cuts[0] : cuts[1]]),
                self._back,
                lambda: self._recovery(plan[cuts[1] :]),
                lambda: self._ordering(streams.last_stream(plan) + 1),
            ]
            for step in steps:
                try:
                    await step()
                except _StepFailed as exc:
                    # The step's own checks cannot be made: it fails with what stopped it.
                    stopped = Check(str(exc), False)
                    self.report.steps[-1].checks.append(stopped)
                    self.report.steps[-1].shown = f"stopped: {exc}"
                    self.display.checks([stopped])
                    break
        finally:
            for writer in self._writers:  # a step that stopped early: its writers go too
                writer.cancel()
            await asyncio.gather(*self._writers, return_exceptions=True)
            await _stop(dispatcher, self._dispatching, self.report.problems)
            dispatcher_log.setLevel(level)

    # -- the steps ------------------------------------------------------------------------

    async def _fan_out(self, writes: list[Write]) -> None:
        self._begin(
            1,
            f"{len(writes)} payment-stream writes for 3 tenants, each enqueuing its event in the"
            " same transaction (a few roll back). Each event goes to every endpoint of its"
            " tenant that subscribes to its type, as a delivery of its own.",
        )
        self._write(writes, rate=self.options.rate)
        await self._until(self._settled, "the fan-out's deliveries")
        events = self._step_events
        healthy = {p: c for p, c in self.cast.items() if p != LEDGER}
        self.before = checks.percentiles(
            checks.latencies(self.ledger, checks.unordered(healthy), {e.key for e in events})
        )
        sent = sum(
            len(checks.expected(p, events) & checks.received(c)) for p, c in self.cast.items()
        )
        self._end(
            [*checks.fan_out(events, self.cast), checks.own_secrets(self.cast)],
            f"{len(events)} events -> {sent} deliveries to {len(self.cast)} endpoints of"
            f" {len(TENANTS)} tenants, by subscription, each signed with its endpoint's secret",
        )

    async def _outage(self, writes: list[Write]) -> None:
        o = self.options
        ledger_id = self.ids[LEDGER]
        self._begin(
            2,
            f"acme/ledger goes down: it holds every request past the {o.request_timeout_ms} ms"
            f" timeout. {len(writes)} more writes. The other endpoints must not notice; after"
            f" failing for {o.disable_after_ms / 1000:g} s ledger is disabled and its"
            " deliveries parked.",
        )
        self.cast[LEDGER].set_mode("hang")
        self._write(writes, rate=o.rate)

        async def disabled_and_parked() -> bool:
            if not await self._healthy_done():
                return False
            endpoint = await endpoints.get(self.admin, ledger_id)
            self._note = f"ledger {endpoint.state}"
            if endpoint.enabled:
                return False
            if await self._count(
                "SELECT count(*) FROM webhook_outbox WHERE endpoint_id = %s AND NOT processed"
                " AND hold IS DISTINCT FROM 'parked'",
                (ledger_id,),
            ):
                return False
            return (
                await self._count(
                    f"SELECT count(*) FROM webhook_outbox WHERE NOT processed AND {OWNED}"
                    " AND hold IS DISTINCT FROM 'parked'",
                    {"prefix": STREAM_PREFIX},
                )
                == 0
            )

        await self._until(disabled_and_parked, "ledger to be disabled and its deliveries parked")
        events = self._step_events
        endpoint = await endpoints.get(self.admin, ledger_id)
        owed = checks.expected(LEDGER, events) - checks.received(self.cast[LEDGER])
        parked = await self._count(
            "SELECT count(*) FROM webhook_outbox WHERE endpoint_id = %s AND NOT processed"
            " AND hold = 'parked'",
            (ledger_id,),
        )
        dead = await self._count(
            "SELECT count(*) FROM webhook_dead_letter WHERE endpoint_id = %s", (ledger_id,)
        )
        healthy = {p: c for p, c in self.cast.items() if p != LEDGER}
        during = checks.percentiles(
            checks.latencies(self.ledger, checks.unordered(healthy), {e.key for e in events})
        )
        p99 = "-" if during is None else checks.ms(during.p99)
        self._end(
            [
                checks.isolation(
                    self.ledger,
                    healthy,
                    events,
                    down=self.cast[LEDGER],
                    timeout_ms=o.request_timeout_ms,
                    before=self.before,
                ),
                *checks.auto_disabled(
                    endpoint,
                    disable_after_ms=o.disable_after_ms,
                    parked=parked,
                    owed=len(owed),
                    dead_letters=dead,
                ),
                checks.operator_told(
                    self.operator,
                    "endpoint.disabled",
                    endpoint_id=ledger_id,
                    tenant=LEDGER.tenant,
                    reason="failing",
                ),
            ],
            f"{self.cast[LEDGER].hung} requests hung at ledger; the others' p99 {p99};"
            f" ledger {_state(endpoint)}, {parked} deliveries parked, {dead} dead letters",
        )

    async def _back(self) -> None:
        ledger_id = self.ids[LEDGER]
        self._begin(
            3,
            "acme/ledger answers again; the operator enables it (`fluxora-webhooks endpoints"
            f" enable {ledger_id}`). Every parked delivery is due at once.",
        )
        cur = await self.admin.execute(
            "SELECT delivery_id::text FROM webhook_outbox WHERE endpoint_id = %s"
            " AND NOT processed AND hold = 'parked'",
            (ledger_id,),
        )
        parked = {str(r[0]) for r in await cur.fetchall()}
        self._step_planned = 0
        self.cast[LEDGER].set_mode("up")
        await endpoints.enable(self.admin, ledger_id)

        async def all_sent() -> bool:
            got = len(parked & self.cast[LEDGER].accepted.keys())
            self._note = f"parked deliveries received {got}/{len(parked)}"
            return got == len(parked) and await self._settled()

        await self._until(all_sent, "ledger's parked deliveries")
        endpoint = await endpoints.get(self.admin, ledger_id)
        self.notes[LEDGER] = f"{len(parked)} parked, then delivered"
        self._end(
            [
                checks.resumed(parked, self.cast[LEDGER], endpoint.state),
                checks.operator_told(
                    self.operator,
                    "endpoint.enabled",
                    endpoint_id=ledger_id,
                    tenant=LEDGER.tenant,
                    reason=None,
                ),
            ],
            f"ledger {_state(endpoint)}; {len(parked & self.cast[LEDGER].accepted.keys())}"
            f"/{len(parked)} parked deliveries sent under their delivery ids",
        )

    async def _recovery(self, writes: list[Write]) -> None:
        billing_id = self.ids[BILLING]
        billing = self.cast[BILLING]
        self._begin(
            4,
            "initech/billing ships a bad deploy to one of its two servers: every second request"
            " is answered 422 (the others pass, so it is not failing long enough to be"
            f" disabled). {len(writes)} more writes; the rejected deliveries become dead"
            " letters. Then billing is fixed and `fluxora-webhooks recover --endpoint"
            f" {billing_id} --since ...` re-queues them.",
        )
        cur = await self.admin.execute("SELECT clock_timestamp()")
        row = await cur.fetchone()
        assert row is not None
        since: datetime = row[0]
        billing.set_mode("reject")
        self._write(writes, rate=self.options.rate)
        await self._until(self._settled, "billing's dead letters")
        events = self._step_events
        owed = checks.expected(BILLING, events)
        dead_ids = await self._dead_ids(billing_id)
        found = checks.dead_lettered(dead_ids, owed, billing, self.operator)
        billing.set_mode("up")
        requeued = await endpoints.recover(self.admin, billing_id, since=since)

        async def delivered() -> bool:
            got = len(dead_ids & billing.accepted.keys())
            self._note = f"recovered deliveries received {got}/{len(dead_ids)}"
            return got == len(dead_ids) and await self._settled()

        await self._until(delivered, "billing's recovered deliveries")
        left = await self._count(
            "SELECT count(*) FROM webhook_dead_letter WHERE endpoint_id = %s AND state = 'dead'",
            (billing_id,),
        )
        self.notes[BILLING] = f"{len(dead_ids)} dead letters, then recovered"
        self._end(
            [*found, checks.recovered(dead_ids, requeued, billing, left)],
            f"{len(dead_ids)} dead letters -> recover re-queued {requeued} ->"
            f" {len(dead_ids & billing.accepted.keys())}/{len(dead_ids)} delivered under their"
            " delivery ids",
        )

    async def _ordering(self, first_stream: int) -> None:
        writes = streams.burst(
            GLOBEX,
            streams=_BURST_STREAMS,
            updates=_BURST_UPDATES,
            first_seq=0,
            first_stream=first_stream,
            seed=self.options.seed,
        )
        ids = list(dict.fromkeys(w.stream_id for w in writes))
        held = self.cast[SYNC].hold_back(ids[0], _HOLD_TIMES)
        self._begin(
            5,
            f"globex/sync is ordered: one stream's events one at a time. {len(ids)} new"
            f" streams, {_BURST_UPDATES + 1} events each; sync answers 503 to the first of"
            f" {ids[0]} {_HOLD_TIMES} times.",
        )
        self._write(writes, rate=_BURST_RATE)
        await self._until(self._settled, "the ordered deliveries")
        self.notes[SYNC] = f"{held.refused} retries of one stream's head, in order"
        found = checks.ordering(self.cast[SYNC], held, ids, self._step_events)
        self._end(
            found,
            f"the head of {held.stream} refused {held.refused} times;"
            f" {checks.delivered_while_held(self.cast[SYNC], held, ids)} events of the other"
            f" streams delivered meanwhile; {len(self.cast[SYNC].order_violations)} out of order",
        )

    async def _finish(self) -> None:
        """The whole run's checks, and the figures of the summary."""
        report = self.report
        report.elapsed_s = time.monotonic() - self._started
        report.committed = len(self.ledger.committed)
        report.rolled_back = len(self.ledger.rolled_back)
        report.standard_library = self.operator.standard_library
        report.operator_events = len(self.operator.accepted)
        report.deliveries = sum(len(c.accepted) for c in self.cast.values())
        for part, consumer in self.cast.items():
            report.parts.append(
                PartReport(
                    part,
                    self.ids.get(part, ""),
                    len(consumer.accepted),
                    consumer.retries,
                    consumer.duplicates,
                    self.notes.get(part, ""),
                )
            )
        pending = await self._count(
            f"SELECT count(*) FROM webhook_outbox WHERE NOT processed AND {OWNED}",
            {"prefix": STREAM_PREFIX},
        )
        dead = await self._count(
            f"SELECT count(*) FROM webhook_dead_letter WHERE state = 'dead' AND {OWNED}",
            {"prefix": STREAM_PREFIX},
        )
        whole = StepReport(0, "Whole run")
        whole.checks = checks.whole_run(
            self.ledger,
            self.cast,
            self.operator,
            pending=pending,
            dead=dead,
            table_agrees=await _table_agrees(self.admin, self.ledger),
        )
        failures = sum(c.signature_failures for c in (*self.cast.values(), self.operator))
        whole.shown = (
            f"{report.committed} writes committed, {report.rolled_back} rolled back;"
            f" {report.deliveries} deliveries; {failures} signature failures; {pending}"
            f" pending, {dead} dead letters"
        )
        report.steps.append(whole)
        self.display.step(0, whole.title, "")
        self.display.checks(whole.checks)

    # -- helpers --------------------------------------------------------------------------

    def _begin(self, number: int, text: str) -> None:
        self._step = number
        self._step_events = []
        self._step_planned = 0
        self._written = 0
        self._note = ""
        self.report.steps.append(StepReport(number, STEPS[number - 1]))
        self.display.step(number, STEPS[number - 1], text)

    def _end(self, found: list[Check], shown: str) -> None:
        self.display.update(self._progress())
        self.report.steps[-1].checks.extend(found)
        self.report.steps[-1].shown = shown
        self.display.checks(found)

    def _write(self, writes: list[Write], *, rate: float) -> None:
        """Start the writers of a step (in the background; :meth:`_until` waits for them)."""
        self._step_planned = len(writes)
        first = writes[0].seq if writes else 0
        start = time.monotonic() - (first / rate if rate > 0 else 0)
        self._shadow = Ledger()
        self._writers = [
            asyncio.create_task(
                streams.run_writer(
                    self.database_url, part, self._shadow, start=start, rate=rate, step=self._step
                ),
                name=f"demo-writer-{i}",
            )
            for i, part in enumerate(streams.shard(writes, self.options.writers))
        ]

    def _collect_writes(self) -> bool:
        """Whether the step's writers are done; their writes go into the ledger."""
        writers, shadow = self._writers, self._shadow
        if shadow is not None:
            self.ledger.committed.update(shadow.committed)
            self.ledger.rolled_back |= shadow.rolled_back
            self._step_events = [c for c in shadow.committed.values()]
            self._written = shadow.written
        for writer in writers:
            if writer.done() and not writer.cancelled() and writer.exception() is not None:
                exc = writer.exception()
                raise _StepFailed(f"a writer failed: {type(exc).__name__}: {exc}")
        return all(w.done() for w in writers)

    async def _until(self, done: Callable[[], Awaitable[bool]], what: str) -> None:
        """Wait for ``done`` (and the step's writers); :class:`_StepFailed` at the timeout."""
        while True:
            writers_done = self._collect_writes()
            self.display.update(self._progress())
            assert self._dispatching is not None
            if self._dispatching.done():
                raise _StepFailed("the dispatcher stopped unexpectedly")
            await self._none_disabled_but(LEDGER if self._step == 2 else None)
            if writers_done and await done():
                break
            if time.monotonic() > self._deadline:
                raise _StepFailed(
                    f"timed out after {self.options.timeout_s:g} s waiting for {what}"
                    + (f" ({self._note})" if self._note else "")
                )
            await asyncio.sleep(_TICK_S)
        await asyncio.sleep(_QUIET_S)  # anything that should not arrive would by now
        self._collect_writes()
        self._writers = []
        self._shadow = None

    def _progress(self) -> Progress:
        events = self._step_events
        keys = {e.key for e in events}
        want = got = 0
        for part, consumer in self.cast.items():
            expected = checks.expected(part, events)
            want += len(expected)
            got += len(expected & checks.received(consumer, keys))
        written = self._shadow.written if self._shadow is not None else self._written
        refused = sum(c.refused for c in self.cast.values())
        retries = sum(c.retries for c in self.cast.values())
        note = f"503s {refused} · retries {retries} · operator events {len(self.operator.accepted)}"
        if self._note:
            note = f"{self._note} · {note}"
        return Progress(
            self._step,
            written,
            self._step_planned,
            got,
            want,
            note,
            time.monotonic() - self._started,
        )

    async def _none_disabled_but(self, allowed: Part | None) -> None:
        """A step fails at once when an endpoint it does not mean to disable is disabled
        (its deliveries would wait, parked, until the timeout)."""
        cur = await self.admin.execute(
            "SELECT id, disabled_reason FROM webhook_endpoints WHERE state = 'disabled'"
            " AND starts_with(tenant, %s)",
            (STREAM_PREFIX,),
        )
        label = {endpoint_id: part.label for part, endpoint_id in self.ids.items()}
        for endpoint_id, reason in await cur.fetchall():
            if allowed is None or endpoint_id != self.ids[allowed]:
                name = label.get(str(endpoint_id), str(endpoint_id))
                raise _StepFailed(f"{name} was disabled ({reason}), which this step does not do")

    async def _healthy_done(self) -> bool:
        """Every endpoint that is up has received the step's events it subscribes to."""
        events = self._step_events
        keys = {e.key for e in events}
        return all(
            checks.expected(p, events) <= checks.received(c, keys)
            for p, c in self.cast.items()
            if c.mode == "up"
        )

    async def _settled(self) -> bool:
        """Every endpoint up has what it must, and nothing of the demo is pending."""
        if not await self._healthy_done():
            return False
        pending = await self._count(
            f"SELECT count(*) FROM webhook_outbox WHERE NOT processed AND {OWNED}",
            {"prefix": STREAM_PREFIX},
        )
        self._note = f"pending {pending}"
        return pending == 0

    async def _dead_ids(self, endpoint_id: str) -> set[str]:
        cur = await self.admin.execute(
            "SELECT delivery_id::text FROM webhook_dead_letter WHERE endpoint_id = %s",
            (endpoint_id,),
        )
        return {str(r[0]) for r in await cur.fetchall()}

    async def _count(self, sql: str, params: Any) -> int:
        cur = await self.admin.execute(sql, params)
        return _count(await cur.fetchone())


def _state(endpoint: endpoints.Endpoint) -> str:
    reason = f" ({endpoint.disabled_reason})" if endpoint.disabled_reason else ""
    return f"{endpoint.state}{reason}"


def _cuts(total: int) -> tuple[int, int]:
    first = round(total * _SHARES[0])
    return first, first + round(total * _SHARES[1])


async def _hold_demo_lock(admin: psycopg.AsyncConnection[Any]) -> None:
    """One demo per database: the lock is held by this session until it closes. A demo
    killed earlier holds nothing: its session ends with it (we wait a moment for that)."""
    deadline = time.monotonic() + _LOCK_WAIT_S
    while True:
        cur = await admin.execute("SELECT pg_try_advisory_lock(%s)", (DEMO_LOCK_KEY,))
        row = await cur.fetchone()
        if row is not None and row[0]:
            return
        if time.monotonic() > deadline:
            raise DemoError("another demo is running on this database; wait for it to finish")
        await asyncio.sleep(0.1)


async def _refuse_foreign_backlog(admin: psycopg.AsyncConnection[Any]) -> None:
    """The demo's dispatcher delivers every due row: refuse to run where events other than
    the demo's are waiting to be sent."""
    cur = await admin.execute(
        f"SELECT count(*) FROM webhook_outbox WHERE NOT processed AND NOT {OWNED}",
        {"prefix": STREAM_PREFIX},
    )
    foreign = _count(await cur.fetchone())
    if foreign:
        raise DemoError(
            f"this database's outbox has {foreign} pending event(s) that are not the demo's;"
            " the demo's dispatcher would deliver them. Run it on a database of its own"
            " (unset DATABASE_URL to use the embedded one)"
        )


async def _stop(dispatcher: Dispatcher, task: asyncio.Task[None], problems: list[str]) -> None:
    dispatcher.stop()
    try:
        await asyncio.wait_for(asyncio.shield(task), _STOP_S)
    except TimeoutError:
        problems.append(f"the dispatcher did not stop within {_STOP_S:g} s")
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    except Exception as exc:
        problems.append(f"the dispatcher failed: {type(exc).__name__}: {exc}")


async def _table_agrees(admin: psycopg.AsyncConnection[Any], ledger: Ledger) -> bool:
    """The table must show exactly the committed writes: each stream at the state of its
    last committed event, and no stream whose creation rolled back."""
    wanted: dict[str, tuple[str, int]] = {}
    for event in ledger.committed.values():
        sid, version = event.payload["id"], event.payload["version"]
        if sid not in wanted or version > wanted[sid][1]:
            wanted[sid] = (event.payload["status"], version)
    cur = await admin.execute("SELECT id, status, version FROM demo_streams")
    actual = {str(r[0]): (str(r[1]), int(r[2])) for r in await cur.fetchall()}
    return actual == wanted


def _count(row: Sequence[Any] | None) -> int:
    return int(row[0]) if row is not None and row[0] is not None else 0
