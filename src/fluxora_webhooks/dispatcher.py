"""The dispatcher: claim loops, wake-ups and drain.

Each claim loop holds one connection and runs batches::

    BEGIN
      claim_due (FOR UPDATE SKIP LOCKED)        -- rows stay locked while we send
      gate.admit (one Redis round trip)         -- rate limit + circuit breaker
      POST every admitted row concurrently      -- aiohttp, keep-alive
      gate.report
      complete (one statement for the batch)    -- processed / retry row / dead letter / deferral
    COMMIT

A crash anywhere before COMMIT releases the locks and leaves the rows for another loop:
at-least-once. A full batch is followed at once by the next claim; otherwise the loop
sleeps until a NOTIFY, the next known due time, or the poll interval, whichever is first.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import aiohttp
import psycopg
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from . import metrics
from .delivery import AttemptResult, attempt, secret_texts
from .errors import ConfigError, EndpointError
from .gate import ALLOW, Admission, DeliveryGate, OpenGate
from .outbox import (
    NOTIFY_CHANNEL,
    Claimed,
    Completion,
    Outcome,
    claim_due,
    complete,
    next_due_in_ms,
    relock_claimed,
)
from .retry import Decision, Kind, RetryPolicy
from .settings import Settings
from .signing import Signer, standard_key
from .urlpolicy import loopback_rule, validate_url

log = logging.getLogger("fluxora_webhooks.dispatcher")

_DB_ERRORS = (psycopg.OperationalError, psycopg.InterfaceError, PoolTimeout)
_BACKOFF_MAX_S = 5.0
_LOCK_TIMEOUT_MS = 10_000
_STATEMENT_TIMEOUT_MS = 60_000
_POOL_RECONNECT_S = 5.0

T = TypeVar("T")


class Waker:
    """Hands each wake-up (a NOTIFY, or a full batch) to one idle claim loop.

    Wake-ups that arrive while no loop is idle are kept (up to ``cap``) so none is lost.
    """

    def __init__(self, cap: int) -> None:
        self._cap = cap
        self._pending = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    def wake(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._pending = min(self._pending + 1, self._cap)

    def wake_all(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
        self._pending = self._cap

    async def wait(self, timeout: float) -> None:
        if self._pending:
            self._pending -= 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter, timeout)
        except TimeoutError:
            pass
        finally:
            if not waiter.done():
                waiter.cancel()
            # A waiter that timed out leaves the queue now, not at the next wake-up: an
            # idle dispatcher would otherwise pile up one per poll.
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)


class Dispatcher:
    """Delivers due outbox rows to one consumer URL until :meth:`stop` is called."""

    def __init__(
        self,
        settings: Settings,
        *,
        conninfo: str,
        gate: DeliveryGate | None = None,
        session: aiohttp.ClientSession | None = None,
        policy: RetryPolicy | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        # Settings built in code skip from_env: the URL policy and the secret are checked
        # here too, so a library user cannot send unsigned or to a refused URL.
        try:
            validate_url(settings.webhook_url)
        except EndpointError as exc:
            raise ConfigError("webhook_url", str(exc)) from None
        for name, secret in (
            ("secret", settings.secret),
            ("secret_previous", settings.secret_previous),
        ):
            if secret is not None and not (secret and standard_key(secret)):
                raise ConfigError(name, "must not be empty (nor whsec_ with no key)")
        self.settings = settings
        self.conninfo = conninfo
        self.url = settings.webhook_url
        self.gate: DeliveryGate = gate or OpenGate()
        self.policy = policy or RetryPolicy(settings.max_attempts, settings.retry_schedule_ms)
        self._signer = Signer(settings.secret, settings.secret_previous)
        # Masked in the response bodies and errors stored with each attempt.
        self._secret_texts = secret_texts(settings.secret, settings.secret_previous)
        # This process's wall clock: only for a Retry-After date that comes without the
        # consumer's Date header. Due times and signed timestamps come from the database.
        self._clock = clock
        self._own_session = session is None
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=settings.timeout_ms / 1000)
        # At most max_connections requests at once in this process. A request waits for a
        # slot here, before its timeout starts: waiting for a connection is not the
        # consumer's failure and must not consume an attempt or trip the breaker.
        self._slots = asyncio.Semaphore(settings.max_connections)
        self._stopping = asyncio.Event()
        self._waker = Waker(cap=settings.claim_loops)
        self._pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] | None = None
        self.ready = asyncio.Event()
        self.batches = 0
        self._outcome = {outcome: metrics.DELIVERIES.labels(outcome) for outcome in Outcome}

    # -- lifecycle -------------------------------------------------------------------

    def stop(self) -> None:
        """Stop claiming; loops finish their in-flight batch, then :meth:`run` returns."""
        self._stopping.set()
        self._waker.wake_all()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    async def run(self) -> None:
        """Run the claim loops and the NOTIFY listener until stopped."""
        loops = self.settings.claim_loops
        self._pool = AsyncConnectionPool(
            self.conninfo,
            min_size=loops,
            max_size=loops + 1,
            kwargs={"autocommit": True},
            configure=self._configure_connection,
            open=False,
            name="fluxora-claim",
            # The pool's own reconnect backoff doubles without a cap (1, 2, 4, ... 64 s):
            # after a long outage it came back long after PostgreSQL did. Each reconnect
            # attempt gives up after a few seconds instead; the claim loops (capped
            # backoff) then ask again, which starts a fresh attempt.
            reconnect_timeout=_POOL_RECONNECT_S,
        )
        await self._pool.open(wait=False)
        if self._session is None:
            self._session = make_session(self.settings)
        tasks = [
            asyncio.create_task(self._claim_loop(i), name=f"fluxora-claim-{i}")
            for i in range(loops)
        ]
        listener = asyncio.create_task(self._listen(), name="fluxora-listen")
        self.ready.set()
        try:
            await asyncio.gather(*tasks)
        finally:
            listener.cancel()
            for task in tasks:
                task.cancel()
            await asyncio.gather(listener, *tasks, return_exceptions=True)
            await self._pool.close()
            if self._own_session and self._session is not None:
                await self._session.close()

    async def _configure_connection(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Session limits of a claim connection. Its transaction idles while the batch's
        requests are in flight, so a server-wide idle_in_transaction_session_timeout shorter
        than the request timeout would kill every slow batch; and a lock that never comes
        (an operator's ALTER TABLE, say) must not hang a claim loop (or a drain) forever."""
        idle_ms = self.settings.timeout_ms + 60_000
        await conn.execute(
            "SELECT set_config('idle_in_transaction_session_timeout', %s, false),"
            " set_config('lock_timeout', %s, false),"
            " set_config('statement_timeout', %s, false)",
            (str(idle_ms), str(_LOCK_TIMEOUT_MS), str(_STATEMENT_TIMEOUT_MS)),
        )

    # -- wake-ups --------------------------------------------------------------------

    async def _listen(self) -> None:
        backoff = 0.1
        while not self.stopping:
            try:
                async with await psycopg.AsyncConnection.connect(
                    self.conninfo, autocommit=True
                ) as conn:
                    await conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
                    backoff = 0.1
                    self._waker.wake_all()  # anything committed while we were not listening
                    async for _ in conn.notifies():
                        self._waker.wake()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self.stopping:
                    return
                log.warning("LISTEN connection lost (%s); reconnecting", type(exc).__name__)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX_S)

    # -- claim loops -----------------------------------------------------------------

    async def _claim_loop(self, index: int) -> None:
        assert self._pool is not None
        backoff = 0.05
        while not self.stopping:
            try:
                conn = await self._unless_stopping(self._pool.getconn(timeout=_POOL_RECONNECT_S))
                if conn is None:
                    return
                try:
                    while not self.stopping:
                        claimed, next_due = await self._run_batch(conn)
                        backoff = 0.05
                        if claimed >= self.settings.batch_size:
                            self._waker.wake()  # more may be due: let an idle loop help
                            continue
                        if claimed:
                            continue  # a partial batch: claim once more before sleeping
                        await self._waker.wait(self._sleep_s(next_due))
                finally:
                    await self._pool.putconn(conn)
            except asyncio.CancelledError:
                raise
            except _DB_ERRORS as exc:
                metrics.CLAIM_ERRORS.inc()
                if self.stopping:
                    return
                log.warning(
                    "claim loop %d: database unavailable (%s); retrying in %.2fs",
                    index,
                    type(exc).__name__,
                    backoff,
                )
            except Exception:
                metrics.CLAIM_ERRORS.inc()
                log.exception("claim loop %d: unexpected error; retrying", index)
            await self._unless_stopping(asyncio.sleep(backoff * (1 + random.random())))
            backoff = min(backoff * 2, _BACKOFF_MAX_S)

    async def _unless_stopping(self, step: Awaitable[T]) -> T | None:
        """``step``'s result, or None as soon as :meth:`stop` is called (``step`` is then
        cancelled): a stop never waits for a pool connection or a back-off."""
        work = asyncio.ensure_future(step)
        stop = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if work.done():
            return work.result()
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError, *_DB_ERRORS):
            late = await work
            if isinstance(late, psycopg.AsyncConnection) and self._pool is not None:
                await self._pool.putconn(late)  # obtained just as the stop came
        return None

    def _sleep_s(self, next_due_ms: int | None) -> float:
        """How long an idle loop waits (a NOTIFY or a busy loop's wake-up cuts it short)."""
        # next_due_in_ms counts only rows due after the claim began (rows due before it are
        # claimed, or held by another loop that completes them), so 0 means one became due
        # meanwhile: claim again at once. Nothing to spin on.
        poll = self.settings.poll_interval_ms
        wait = poll if next_due_ms is None else min(poll, next_due_ms + 1)
        return max(wait, 1) / 1000

    async def _run_batch(self, conn: psycopg.AsyncConnection[Any]) -> tuple[int, int | None]:
        """One claim transaction. Returns (rows claimed, ms until the next future due row)."""
        completions: list[Completion] = []
        try:
            async with conn.transaction():
                rows = await claim_due(conn, self.settings.batch_size)
                if rows:
                    completions = await self._attempt_batch(rows)
                    completions = await self._record(conn, completions)
                claimed = len(rows)
                next_due = await next_due_in_ms(conn) if claimed < self.settings.batch_size else 0
        except _DB_ERRORS:
            raise
        except psycopg.Error as exc:
            if not completions:
                raise  # nothing was sent: the claim itself failed
            log.error("batch completion failed (%s); completing row by row", type(exc).__name__)
            claimed, next_due = len(completions), 0
            completions = await self._complete_row_by_row(conn, completions)
        self._count_outcomes(completions)
        self.batches += 1
        return claimed, next_due

    async def _attempt_batch(self, rows: Sequence[Claimed]) -> list[Completion]:
        admissions = await self._admit(rows)
        sends = [self._send(row) for row, adm in zip(rows, admissions, strict=True) if adm.allowed]
        results = iter(await asyncio.gather(*sends))
        completions: list[Completion] = []
        reports: list[tuple[Admission, bool | None]] = []
        for row, adm in zip(rows, admissions, strict=True):
            if not adm.allowed:
                completions.append(
                    Completion(row.id, Outcome.DEFERRED, delay_ms=max(adm.delay_ms, 1))
                )
                continue
            result = next(results)
            reports.append((adm, _breaker_signal(result)))
            completions.append(self._decide(row, result))
        if reports:
            try:
                await self.gate.report(self.url, reports)
            except Exception:  # the gate fails open; a broken one must not undo the batch
                log.exception("delivery gate report failed; ignored")
        return completions

    async def _admit(self, rows: Sequence[Claimed]) -> list[Admission]:
        try:
            # The gate treats attempt numbers above 1 as retries; a replay counts as one.
            attempts = [max(row.attempt, 2) if row.is_retry else 1 for row in rows]
            admissions = await self.gate.admit(self.url, attempts)
        except Exception:
            log.exception("delivery gate failed; admitting the batch (fail open)")
            metrics.REDIS_FAIL_OPEN.labels("gate").inc()
            return [ALLOW] * len(rows)
        if len(admissions) != len(rows):
            log.error("delivery gate answered %d decisions for %d rows", len(admissions), len(rows))
            return [ALLOW] * len(rows)
        return admissions

    async def _send(self, row: Claimed) -> AttemptResult:
        async with self._slots:
            return await self._send_now(row)

    async def _send_now(self, row: Claimed) -> AttemptResult:
        assert self._session is not None
        metrics.IN_FLIGHT.inc()
        try:
            headers = self._signer.headers(
                delivery_id=row.delivery_id,
                event_type=row.event_type,
                attempt=row.attempt,
                body=row.body,
                timestamp=row.timestamp,
            )
            result = await attempt(
                self._session,
                self.url,
                row.body,
                headers,
                timeout=self._timeout,
                max_response_bytes=self.settings.max_response_bytes,
                clock=self._clock,
                secrets=self._secret_texts,
            )
        except Exception as exc:  # one bad row never takes the batch down
            log.exception("delivery %s: unexpected error building the attempt", row.delivery_id)
            result = AttemptResult(
                Kind.PERMANENT,
                error=f"internal error: {type(exc).__name__}",
                reason="internal_error",
            )
        finally:
            metrics.IN_FLIGHT.dec()
        metrics.ATTEMPT_DURATION.observe(result.duration_ms / 1000)
        return result

    def _decide(self, row: Claimed, result: AttemptResult) -> Completion:
        decision = self.policy.decide(
            row.attempt, result.kind, reason=result.reason, retry_after_ms=result.retry_after_ms
        )
        if decision.outcome is not Outcome.RETRY:
            metrics.ATTEMPTS_PER_DELIVERY.observe(row.attempt)
        if decision.outcome is Outcome.DELIVERED:
            if log.isEnabledFor(logging.DEBUG):  # the fields are built only when logged
                log.debug("delivered", extra=_log_fields(row, result))
        elif decision.outcome is Outcome.RETRY:
            log.info(
                "delivery %s attempt %d failed (%s); retry in %.1fs",
                row.delivery_id,
                row.attempt,
                result.error or result.status,
                decision.delay_ms / 1000,
                extra=_log_fields(row, result),
            )
        else:
            log.warning(
                "delivery %s goes to the dead letters after attempt %d: %s (%s)",
                row.delivery_id,
                row.attempt,
                decision.reason,
                result.error or result.status,
                extra=_log_fields(row, result),
            )
        return _completion(row, result, decision)

    async def _record(
        self, conn: psycopg.AsyncConnection[Any], completions: list[Completion]
    ) -> list[Completion]:
        """Write the batch's outcomes in its claim transaction; returns what was recorded.

        A batch where every row was delivered is one UPDATE, written without a savepoint:
        SAVEPOINT and RELEASE cost two more round trips and a subtransaction, about a fifth
        of the database's CPU per batch (docs/performance.md); if it fails anyway, the
        transaction rolls back and _run_batch relocks and records row by row. A batch that
        inserts retries or dead letters gets a savepoint, so a row the database rejects
        is recorded on its own while the others keep their locks (no window in which
        another loop could claim and re-send them)."""
        if all(c.outcome is Outcome.DELIVERED for c in completions):
            await complete(conn, completions)
            return completions
        try:
            async with conn.transaction():
                await complete(conn, completions)
            return completions
        except _DB_ERRORS:
            raise
        except psycopg.Error as exc:
            log.error("batch completion failed (%s); completing row by row", type(exc).__name__)
        recorded = [await self._complete_one(conn, one) for one in completions]
        return [one for one in recorded if one is not None]

    async def _complete_row_by_row(
        self, conn: psycopg.AsyncConnection[Any], completions: Sequence[Completion]
    ) -> list[Completion]:
        """After a batch statement failed and its transaction rolled back: lock again the
        rows that are still ours to record and record each on its own (a savepoint each),
        so one bad row never undoes the others. A row another loop claimed meanwhile is
        skipped: that loop sends it again and records its own attempt (at-least-once).
        Returns what was recorded."""
        recorded: list[Completion] = []
        async with conn.transaction():
            mine = await relock_claimed(conn, [c.id for c in completions])
            for one in completions:
                if one.id in mine:
                    done = await self._complete_one(conn, one)
                    if done is not None:
                        recorded.append(done)
        return recorded

    def _count_outcomes(self, completions: Sequence[Completion]) -> None:
        for one in completions:
            if one.outcome is Outcome.DEAD_LETTER:
                metrics.DEAD_LETTERS.labels(one.reason or "unknown").inc()
            self._outcome[one.outcome].inc()

    async def _complete_one(
        self, conn: psycopg.AsyncConnection[Any], one: Completion
    ) -> Completion | None:
        """Record one row's outcome; failing that, dead-letter it; failing that, defer it a
        minute (never left due at once: that would re-send it in a tight loop). Returns what
        was recorded (None: nothing could be; the row stays pending)."""
        fallbacks = (
            one,
            Completion(
                one.id,
                Outcome.DEAD_LETTER,
                status_code=one.status_code,
                error=f"could not record outcome {one.outcome!r}: database rejected the row",
                reason="internal_error",
            ),
            Completion(one.id, Outcome.DEFERRED, delay_ms=60_000),
        )
        for recording in fallbacks:
            try:
                async with conn.transaction():
                    await complete(conn, [recording])
                return recording
            except _DB_ERRORS:
                raise
            except psycopg.Error as exc:
                log.error(
                    "row %d: recording %s failed (%s)", one.id, recording.outcome, exc.sqlstate
                )
        log.error("row %d: could not be completed at all; it stays pending", one.id)
        return None


def _completion(row: Claimed, result: AttemptResult, decision: Decision) -> Completion:
    return Completion(
        row.id,
        decision.outcome,
        delay_ms=decision.delay_ms,
        status_code=result.status,
        error=result.error,
        response_body=result.body,
        duration_ms=result.duration_ms,
        reason=decision.reason,
    )


def _breaker_signal(result: AttemptResult) -> bool | None:
    if result.kind is Kind.DELIVERED:
        return True
    if result.kind is Kind.RETRYABLE:
        return False
    return None


def _log_fields(row: Claimed, result: AttemptResult) -> dict[str, Any]:
    return {
        "delivery_id": row.delivery_id,
        "event_type": row.event_type,
        "attempt": row.attempt,
        "status": result.status,
        "duration_ms": round(result.duration_ms, 2),
    }


def make_session(settings: Settings) -> aiohttp.ClientSession:
    """The HTTP client: keep-alive, bounded connections, the connect-time address policy
    (resolved addresses are checked and the connection is pinned to them)."""
    from .connector import make_connector

    rule = loopback_rule(settings.webhook_url)
    connector = make_connector(
        allow_loopback=rule.allow,
        require_loopback=rule.require,
        allowed_networks=settings.allowed_networks,
        limit=settings.max_connections,
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=settings.timeout_ms / 1000),
        # Response bodies are kept as the attempt record, raw: ask for them uncompressed.
        headers={"Accept-Encoding": "identity"},
        auto_decompress=False,
        raise_for_status=False,
    )
