"""The demo's wiring, and the check that the result is what the guarantees promise.

One process, one event loop: writers (the application), the dispatcher (with the Redis
gate) and the consumer. The run ends when every committed event has been accepted by the
consumer and the outbox holds no pending row of the demo, or at the timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg

from ..dispatcher import Dispatcher
from ..errors import FluxoraError
from ..gate import DeliveryGate
from ..migrations import migrate
from ..redis_gate import gate_for
from ..settings import Settings
from . import streams
from .consumer import Consumer
from .streams import STREAM_PREFIX, Committed, Ledger

# Arbitrary but fixed: the advisory lock a running demo holds on its database.
DEMO_LOCK_KEY = 0x666C7864656D6F
_LOCK_WAIT_S = 10.0
_TICK_S = 0.1
# After the last delivery: how long to keep listening for anything that should not come.
_QUIET_S = 0.3
_STOP_S = 15.0


class DemoError(FluxoraError):
    """The demo cannot run here (its database is in use, or holds others' events)."""


@dataclass(frozen=True)
class DemoOptions:
    events: int = 300
    seed: int = 1
    rate: float = 150.0  # stream writes per second; 0: as fast as possible
    writers: int = 4
    timeout_s: float = 90.0
    refuse_every: int = 7  # the consumer answers 503 to this share of first attempts
    retry_delay_ms: int = 200
    retry_rps: int = 10  # the Redis rate limit of retries (WEBHOOK_RETRY_RPS's default)
    redis_prefix: str = ""


@dataclass(frozen=True)
class Snapshot:
    """Progress so far, for the display."""

    planned: int
    written: int
    committed: int
    rolled_back: int
    delivered: int
    refused: int
    retries: int
    duplicates: int
    signature_failures: int
    elapsed_s: float


@dataclass(frozen=True)
class Percentiles:
    p50: float
    p95: float
    p99: float
    count: int


@dataclass
class DemoReport:
    """What happened, and what went wrong (``problems`` empty: the guarantees held)."""

    options: DemoOptions
    snapshot: Snapshot
    missing: int = 0  # committed, not delivered
    from_rolled_back: int = 0  # received, though its write rolled back
    unknown: int = 0  # received, never written by this run
    altered: int = 0  # delivered with another body or event type than committed
    dead_letters: int = 0
    rate_limit_deferrals: int = 0
    standard_library: bool = False
    latency_first_ms: Percentiles | None = None
    latency_delivered_ms: Percentiles | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


class Display:
    """What the runner reports to while it runs (see :mod:`.display`)."""

    def start(self, consumer_url: str) -> None: ...

    def update(self, snapshot: Snapshot) -> None: ...

    def stop(self, snapshot: Snapshot) -> None: ...


async def run_demo(
    options: DemoOptions,
    *,
    database_url: str,
    redis_url: str,
    display: Display | None = None,
) -> DemoReport:
    """Run the demo on these engines; raises :class:`DemoError` when it cannot start."""
    return await _DemoRun(options, database_url, redis_url, display or Display()).run()


class _DemoRun:
    def __init__(
        self, options: DemoOptions, database_url: str, redis_url: str, display: Display
    ) -> None:
        self.options = options
        self.database_url = database_url
        self.redis_url = redis_url
        self.display = display
        self.secret = secrets.token_urlsafe(32).encode()
        self.ledger = Ledger(planned=options.events)
        self.consumer = Consumer(self.secret, refuse_every=options.refuse_every)
        self.problems: list[str] = []
        self._started = time.monotonic()

    def snapshot(self) -> Snapshot:
        return _snapshot(self.ledger, self.consumer, time.monotonic() - self._started)

    async def run(self) -> DemoReport:
        async with await psycopg.AsyncConnection.connect(
            self.database_url, autocommit=True, connect_timeout=10
        ) as admin:
            await migrate(admin)
            await _hold_demo_lock(admin)
            await _refuse_foreign_backlog(admin)
            await streams.prepare(admin)
            await self.consumer.start()
            try:
                settings = _settings(self.options, self.consumer.url, self.secret)
                gate = await gate_for(settings, self.redis_url)
                try:
                    await self._dispatch_and_write(settings, gate, admin)
                finally:
                    await gate.close()
            finally:
                await self.consumer.stop()
            report = DemoReport(
                self.options, self.snapshot(), standard_library=self.consumer.standard_library
            )
            report.problems.extend(self.problems)
            await _check(admin, self.ledger, self.consumer, report)
        return report

    async def _dispatch_and_write(
        self, settings: Settings, gate: DeliveryGate, admin: psycopg.AsyncConnection[Any]
    ) -> None:
        """Start the dispatcher, run the writers, wait for the deliveries; stop it all."""
        dispatcher = Dispatcher(settings, conninfo=self.database_url, gate=gate)
        dispatching = asyncio.create_task(dispatcher.run(), name="demo-dispatcher")
        writers: list[asyncio.Task[None]] = []
        # The dispatcher logs each retry at INFO: the display shows them as a count instead.
        dispatcher_log = logging.getLogger("fluxora_webhooks.dispatcher")
        level = dispatcher_log.level
        if dispatcher_log.getEffectiveLevel() < logging.WARNING:
            dispatcher_log.setLevel(logging.WARNING)
        self.display.start(self.consumer.url)
        try:
            await asyncio.wait_for(dispatcher.ready.wait(), 30)
            start = time.monotonic()
            plan = streams.plan(self.options.events, self.options.seed)
            writers = [
                asyncio.create_task(
                    streams.run_writer(
                        self.database_url, part, self.ledger, start=start, rate=self.options.rate
                    ),
                    name=f"demo-writer-{i}",
                )
                for i, part in enumerate(streams.shard(plan, self.options.writers))
            ]
            await self._wait(dispatching, writers, admin)
        finally:
            for writer in writers:
                writer.cancel()
            for result in await asyncio.gather(*writers, return_exceptions=True):
                if isinstance(result, Exception):
                    self.problems.append(f"a writer failed: {type(result).__name__}: {result}")
            await _stop(dispatcher, dispatching, self.problems)
            dispatcher_log.setLevel(level)
            self.display.stop(self.snapshot())

    async def _wait(
        self,
        dispatching: asyncio.Task[None],
        writers: list[asyncio.Task[None]],
        admin: psycopg.AsyncConnection[Any],
    ) -> None:
        deadline = time.monotonic() + self.options.timeout_s
        while True:
            self.display.update(self.snapshot())
            if dispatching.done():
                self.problems.append("the dispatcher stopped unexpectedly")
                return
            if all(w.done() for w in writers):
                if any(not w.cancelled() and w.exception() is not None for w in writers):
                    return  # reported when the writers are collected
                if await _all_delivered(admin, self.ledger, self.consumer):
                    break
            if time.monotonic() > deadline:
                self.problems.append(
                    f"timed out after {self.options.timeout_s:g} s"
                    f" ({self.ledger.written} of {self.options.events} writes done)"
                )
                return
            await asyncio.sleep(_TICK_S)
        await asyncio.sleep(_QUIET_S)  # anything that should not arrive would by now


def _settings(options: DemoOptions, url: str, secret: bytes) -> Settings:
    return Settings(
        webhook_url=url,
        secret=secret,
        poll_interval_ms=1000,  # a fallback only: LISTEN/NOTIFY wakes the dispatcher
        batch_size=20,
        claim_loops=4,
        retry_schedule_ms=(options.retry_delay_ms,),
        retry_rps=options.retry_rps,
        max_attempts=8,
        timeout_ms=5000,
        metrics_port=0,
        # A prefix of its own per run: nothing a killed run left in Redis applies.
        redis_prefix=f"{options.redis_prefix}fluxora-demo:{secrets.token_hex(4)}:",
    )


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
    """The demo's dispatcher delivers every due row to the demo's consumer: refuse to run
    where events other than the demo's are waiting to be sent."""
    cur = await admin.execute(
        "SELECT count(*) FROM webhook_outbox WHERE NOT processed"
        " AND NOT starts_with(stream_id, %s)",
        (STREAM_PREFIX,),
    )
    foreign = _count(await cur.fetchone())
    if foreign:
        raise DemoError(
            f"this database's outbox has {foreign} pending event(s) that are not the demo's;"
            " the demo would deliver them to its own consumer. Run it on a database of its"
            " own (unset DATABASE_URL to use the embedded one)"
        )


async def _all_delivered(
    admin: psycopg.AsyncConnection[Any], ledger: Ledger, consumer: Consumer
) -> bool:
    if not ledger.committed.keys() <= consumer.accepted.keys():
        return False
    # The consumer has them all; wait for the dispatcher to record it (its COMMIT).
    cur = await admin.execute(
        "SELECT count(*) FROM webhook_outbox WHERE NOT processed AND starts_with(stream_id, %s)",
        (STREAM_PREFIX,),
    )
    row = await cur.fetchone()
    return row is not None and int(row[0]) == 0


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


def _snapshot(ledger: Ledger, consumer: Consumer, elapsed_s: float) -> Snapshot:
    return Snapshot(
        planned=ledger.planned,
        written=ledger.written,
        committed=len(ledger.committed),
        rolled_back=len(ledger.rolled_back),
        delivered=len(consumer.accepted.keys() & ledger.committed.keys()),
        refused=consumer.refused,
        retries=consumer.retries,
        duplicates=consumer.duplicates,
        signature_failures=consumer.signature_failures,
        elapsed_s=elapsed_s,
    )


async def _check(
    admin: psycopg.AsyncConnection[Any], ledger: Ledger, consumer: Consumer, report: DemoReport
) -> None:
    """Compare what was committed, what the consumer accepted and what the database holds."""
    problems = report.problems
    committed, accepted = ledger.committed, consumer.accepted
    received = consumer.first_seen.keys() | accepted.keys()

    report.missing = len(committed.keys() - accepted.keys())
    if report.missing:
        problems.append(f"{report.missing} committed event(s) were not delivered")
    report.from_rolled_back = len(received & ledger.rolled_back)
    if report.from_rolled_back:
        problems.append(
            f"{report.from_rolled_back} event(s) of rolled-back writes reached the consumer"
        )
    report.unknown = len(received - committed.keys() - ledger.rolled_back)
    if report.unknown:
        problems.append(f"the consumer received {report.unknown} event(s) the demo never wrote")
    altered = [
        did
        for did, got in accepted.items()
        if did in committed and not _same_event(got.event_type, got.body, committed[did])
    ]
    report.altered = len(altered)
    if altered:
        problems.append(f"{len(altered)} delivered event(s) differ from what was committed")
    if consumer.signature_failures:
        problems.append(
            f"{consumer.signature_failures} request(s) failed signature verification"
            f" (first: {consumer.failure_reasons[0]})"
        )

    cur = await admin.execute(
        "SELECT count(*) FROM webhook_dead_letter WHERE starts_with(stream_id, %s)",
        (STREAM_PREFIX,),
    )
    report.dead_letters = _count(await cur.fetchone())
    if report.dead_letters:
        problems.append(f"{report.dead_letters} event(s) were dead-lettered")
    cur = await admin.execute(
        "SELECT coalesce(sum(deferrals), 0) FROM webhook_outbox WHERE starts_with(stream_id, %s)",
        (STREAM_PREFIX,),
    )
    report.rate_limit_deferrals = _count(await cur.fetchone())
    cur = await admin.execute(
        "SELECT count(*) FROM webhook_outbox WHERE delivery_id = ANY(%s::uuid[])",
        (sorted(ledger.rolled_back),),
    )
    leaked = _count(await cur.fetchone())
    if leaked:
        problems.append(f"the outbox holds {leaked} row(s) of rolled-back writes")
    await _check_streams(admin, ledger, problems)

    delivered = [did for did in committed if did in accepted]
    report.latency_first_ms = percentiles(
        [consumer.first_seen[did] - committed[did].committed_at for did in delivered]
    )
    report.latency_delivered_ms = percentiles(
        [accepted[did].at - committed[did].committed_at for did in delivered]
    )


async def _check_streams(
    admin: psycopg.AsyncConnection[Any], ledger: Ledger, problems: list[str]
) -> None:
    """The table must show exactly the committed writes: each stream at the state of its
    last committed event, and no stream whose creation rolled back."""
    expected: dict[str, tuple[str, int]] = {}
    for event in ledger.committed.values():
        sid, version = event.payload["id"], event.payload["version"]
        if sid not in expected or version > expected[sid][1]:
            expected[sid] = (event.payload["status"], version)
    cur = await admin.execute("SELECT id, status, version FROM demo_streams")
    actual = {str(r[0]): (str(r[1]), int(r[2])) for r in await cur.fetchall()}
    if actual != expected:
        wrong = len(set(actual.items()) ^ set(expected.items()))
        problems.append(f"demo_streams disagrees with the committed events ({wrong} row(s))")


def _same_event(event_type: str, body: bytes, committed: Committed) -> bool:
    try:
        payload = json.loads(body)
    except ValueError:
        return False
    return event_type == committed.event_type and payload == committed.payload


def _count(row: Sequence[Any] | None) -> int:
    return int(row[0]) if row is not None and row[0] is not None else 0


def percentiles(seconds: Sequence[float]) -> Percentiles | None:
    """p50/p95/p99 in milliseconds (nearest rank), None for no values."""
    if not seconds:
        return None
    ordered = sorted(max(0.0, s) * 1000 for s in seconds)

    def rank(p: int) -> float:
        return ordered[max(0, math.ceil(p * len(ordered) / 100) - 1)]

    return Percentiles(rank(50), rank(95), rank(99), len(ordered))
