"""The dispatcher: claim loops, wake-ups, the endpoint cache, sending, and drain.

Each claim loop holds one connection and runs :class:`~fluxora_webhooks.batch.Batch` after
batch (see that module for one claim transaction). A full batch is followed at once by the
next claim; otherwise the loop sleeps until a NOTIFY, the next known due time, or the poll
interval, whichever is first. One listener connection hears both the outbox (a commit with
rows due now) and the endpoint registry (a change: that endpoint is reloaded).

Isolation (SPEC 11): each endpoint may hold at most ``WEBHOOK_ENDPOINT_CONCURRENCY``
requests of this process at once, and the requests that outlived their batch together at
most half of ``WEBHOOK_MAX_CONNECTIONS``; a row past either limit is deferred (no attempt
consumed) instead of waiting, so no batch waits for another endpoint's requests.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import logging
import math
import random
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, TypeVar

import psycopg
from psycopg_pool import AsyncConnectionPool

from . import egress, endpoints, logs, metrics, partitions
from .batch import (
    DB_ERRORS,
    LOCK_TIMEOUT_MS,
    PATIENCE_S,
    REFUSED_ERRORS,
    STATEMENT_TIMEOUT_MS,
    Batch,
    ClaimFront,
    Resume,
    Send,
    breaker_signal,
    gone_retried,
    outage,
)
from .clientcerts import EXPIRED, NOT_YET_VALID, ClientTls, validity
from .connector import SafeResolver
from .delivery import EGRESS, HELD, AttemptResult, attempt, secret_texts
from .egress import EgressHold, ResolverWatch
from .errors import ConfigError, EndpointError
from .gate import ALLOW, Admission, AdmitRequest, DeliveryGate, OpenGate, Signal
from .httpclient import HttpClient, client_ssl_context, warm_ssl_context
from .migrations import READ_ONLY_HINT, discard, read_only_reason
from .outbox import (
    ENDPOINTS_CHANNEL,
    MAX_EVENT_TYPE,
    NOTIFY_CHANNEL,
    Claimed,
    Outcome,
    bring_forward,
)
from .pgtypes import SESSION_SETTINGS_SQL, described, read_far_timestamps, session_name
from .recording import Completer, Recorder
from .retry import Decision, Kind, RetryPolicy
from .settings import Settings
from .signing import Signer, standard_key
from .targets import Load, Target, Targets, Turns
from .telemetry import AttemptTracer
from .tracing import passthrough
from .urlpolicy import loopback_rule, validate_url
from .waker import Waker

__all__ = ["Dispatcher", "Waker", "make_client"]

log = logging.getLogger("fluxora_webhooks.dispatcher")

_BACKOFF_MAX_S = 5.0
_POOL_RECONNECT_S = 5.0
# What a detached request never sent returns (its row is put back by the completer; a
# detached request's result is read by nobody else).
NOT_SENT = AttemptResult(Kind.RETRYABLE, error="not sent")
# The whole registry is read again this often (a fallback for a missed NOTIFY, and the end
# of a rotated secret's overlap), and on a partitioned outbox, where pending rows start
# (a row written before the last reading by a transaction older than a partition waits
# this long at most).
HOUSEKEEPING_S = 10.0
# Ordered streams whose next head was never chosen (a failure after the outcome was
# recorded) are looked for this often.
SWEEP_S = 30.0
# A row of an endpoint at its concurrency (WEBHOOK_ENDPOINT_CONCURRENCY) that is not slow
# is due again this much later: long enough that its claim loops do not spin on it, short
# enough that a fast endpoint's burst flows at its concurrency.
BUSY_DEFER_S = 0.02
# How far ahead a slow endpoint's rows past its concurrency are spaced out, in timeouts.
SLOW_HORIZON_TIMEOUTS = 4
# URLs whose address policy is remembered (one entry per endpoint URL; cleared past this).
_POLICY_KEYS_MAX = 100_000
# Rows made due again per statement (Dispatcher._forward): each a lock until its commit.
FORWARD_CHUNK = 1000
# How often a dispatcher says that the egress proxy or the resolver fails (_HeldSaid).
EGRESS_LOG_EVERY_S = 30.0

T = TypeVar("T")


async def unless_stopping(
    step: Awaitable[T],
    stopping: asyncio.Event,
    *,
    late: Callable[[T], Awaitable[None]] | None = None,
) -> T | None:
    """``step``'s result (or its error), or None as soon as ``stopping`` is set: ``step`` is
    then cancelled, and what it still produced (a connection obtained just as the stop
    came) is handed to ``late``."""
    work = asyncio.ensure_future(step)
    stop = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
    if work.done():
        return work.result()
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError, *DB_ERRORS):
        result = await work
        if late is not None:
            await late(result)
    return None


class Dispatcher:
    """Delivers due outbox rows to every endpoint until :meth:`stop` is called: the table's
    endpoints, and the built-in ``default`` (``settings.webhook_url``) and ``operator``
    (``settings.operator_url``) when configured."""

    def __init__(
        self,
        settings: Settings,
        *,
        conninfo: str,
        gate: DeliveryGate | None = None,
        client: HttpClient | None = None,
        policy: RetryPolicy | None = None,
        clock: Callable[[], float] = time.time,
        tracer: AttemptTracer | None = None,
    ) -> None:
        env: dict[str, tuple[str, Signer]] = {}
        env_secrets: dict[str, tuple[str, ...]] = {}
        self._promotions: set[asyncio.Task[None]] = set()  # see promote_busy
        self._busy_streams: set[tuple[str, str]] = set()  # waiting for _promoter
        self._promoter: asyncio.Task[None] | None = None
        # Settings built in code skip from_env: the URL policy and the secret are checked
        # here too, so a library user cannot send unsigned or to a refused URL.
        for name, url, secret, previous in (
            (endpoints.DEFAULT_ID, settings.webhook_url, settings.secret, settings.secret_previous),
            (endpoints.OPERATOR_ID, settings.operator_url, settings.operator_secret, None),
        ):
            if not url:
                continue
            try:
                validate_url(url)
            except EndpointError as exc:
                raise ConfigError(f"{name} url", str(exc)) from None
            for what, key in (("secret", secret), ("previous secret", previous)):
                if key is not None and not (key and standard_key(key)):
                    raise ConfigError(
                        f"{name} {what}", "must not be empty (nor whsec_ with no key)"
                    )
            env[name] = (url, Signer(secret, previous))
            env_secrets[name] = secret_texts(secret, previous)
        self.settings = settings
        self.conninfo = conninfo
        self.url = settings.webhook_url
        self.gate: DeliveryGate = gate or OpenGate()
        self.policy = policy or RetryPolicy(settings.max_attempts, settings.retry_schedule_ms)
        self.targets = Targets(env, env_secrets, settings.encryption_keys)
        self.recorder = Recorder(self)
        self.completer = Completer(self)
        # When the next row deferred because the detached requests hold their share may
        # come back (slow_share_wait_s): the share frees as they end, whatever endpoint.
        self._share_turns = Turns()
        self._background: set[asyncio.Task[None]] = set()  # bring_forward's
        # This process's wall clock: only for a Retry-After date that comes without the
        # consumer's Date header. Due times and signed timestamps come from the database.
        self._clock = clock
        # With the otel extra and OTEL_* set: one span per attempt. None: a valid stored
        # trace context is passed through as it is, and nothing else is done per request.
        self.tracer = tracer
        # One client per address policy: (built-in?, allow loopback, require loopback). A
        # client given to the constructor (tests) serves every endpoint.
        self._given_client = client
        self._clients: dict[tuple[bool, bool, bool], HttpClient] = {}
        # Endpoints with a client certificate of their own: a client per address policy
        # and certificate, so that a connection made presenting one certificate is never
        # reused for an endpoint of another (or of none) on the same origin.
        self._tls_clients: dict[tuple[tuple[bool, bool, bool], str], HttpClient] = {}
        self._policy_keys: dict[tuple[bool, str], tuple[bool, bool, bool]] = {}
        # Batches whose COMMIT is under way: when each began (monotonic).
        self._committing: dict[int, float] = {}
        self._in_flight = 0
        self._stopping = asyncio.Event()
        self._waker = Waker(cap=settings.claim_loops)
        self.claim_front = ClaimFront()  # where the loops' resumed claims may start
        self._pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] | None = None
        self._warned: set[str] = set()
        self.egress = EgressHold()  # the proxy's health, as this process sees it
        self._egress_said = _HeldSaid(
            metrics.EGRESS_FAILURES,
            "the egress proxy failed (%s); %d attempt(s) failed at it since the last report:"
            " their deliveries are held with the attempt unused, counted against no endpoint,"
            " and one request every %.0fs tries the proxy again",
        )
        # The DNS resolver's health, shared by this process's clients (a given client's own).
        self.resolving = client.resolving if client is not None else ResolverWatch()
        self._resolver_said = _HeldSaid(
            metrics.RESOLVER_FAILURES,
            "DNS lookups fail on this machine (%s); %d attempt(s) held since the last"
            " report: their deliveries wait with the attempt unused, counted against no"
            " endpoint, and one lookup every %.0fs tries the resolver again",
        )
        # On a partitioned outbox: no row written before this is pending (the claim looks
        # only at the partitions from there on). None: look everywhere.
        self.claim_since: datetime | None = None
        self.ready = asyncio.Event()
        # Why the database refused the last claim's write (a standby), until one succeeds.
        self.read_only: str | None = None
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
        """Run the claim loops, the listener and the completer until stopped."""
        loops = self.settings.claim_loops
        self._pool = AsyncConnectionPool(
            self.conninfo,
            min_size=loops,
            max_size=loops + 2,
            kwargs={"autocommit": True, **session_name(self.conninfo, APPLICATION_NAME)},
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
        # The trust store for https consumers, loaded in a thread now rather than on the
        # event loop at the first https request (where it stalled every request in flight).
        await warm_ssl_context(self.settings.tls_client_cert, self.settings.tls_client_key)
        background = [
            asyncio.create_task(self._listen(), name="fluxora-listen"),
            asyncio.create_task(self.completer.run(), name="fluxora-completer"),
            asyncio.create_task(self._housekeeping(), name="fluxora-registry"),
        ]
        tasks = [
            asyncio.create_task(self._claim_loop(i), name=f"fluxora-claim-{i}")
            for i in range(loops)
        ]
        try:
            # The built-in endpoints are in the registry before this dispatcher is ready, so
            # an operator event written right after its start (an endpoint disabled from the
            # CLI) finds the operator endpoint it goes to. If the database does not answer
            # now, the registry task keeps trying.
            with contextlib.suppress(Exception):
                async with asyncio.timeout(_POOL_RECONNECT_S):
                    await self.with_connection(self._sync_builtins)
            self.ready.set()
            await asyncio.gather(*tasks)
            # Requests that outlived their batch: recorded before we go, within the bound
            # of one request (their rows are leased, so nothing is lost if we cannot).
            await self.completer.drain(self.settings.timeout_ms / 1000 + 1)
        finally:
            # Promotions still waiting for a stream's lock are left to the sweep.
            for task in (*background, *tasks, *self._promotions):
                task.cancel()
            await asyncio.gather(*background, *tasks, *self._promotions, return_exceptions=True)
            await self._pool.close()
            for client in self._clients.values():
                await client.close()
            for client in self._tls_clients.values():
                await client.close()

    async def _configure_connection(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Session limits of a claim connection. Its transaction idles while the batch's
        requests are in flight, so a server-wide idle_in_transaction_session_timeout shorter
        than the request timeout would kill every slow batch; and a lock that never comes
        (an operator's ALTER TABLE, say) must not hang a claim loop (or a drain) forever.
        A due time out of Python's range is read, not refused (pgtypes); the session's
        DateStyle, isolation and float digits are ours (pgtypes.SESSION_SETTINGS). The
        dispatcher's own inserts (the deliveries a routing batch leaves to other processes,
        operator events) keep their wake-up where the producers' is switched off for the
        database or a role (``fluxora.notify``)."""
        read_far_timestamps(conn)
        idle_ms = self.settings.timeout_ms + 60_000
        await conn.execute(
            "SELECT set_config('idle_in_transaction_session_timeout', %s, false),"
            " set_config('lock_timeout', %s, false),"
            " set_config('statement_timeout', %s, false),"
            " set_config('fluxora.notify', 'on', false), " + SESSION_SETTINGS_SQL,
            (str(idle_ms), str(LOCK_TIMEOUT_MS), str(STATEMENT_TIMEOUT_MS)),
        )

    async def with_connection(
        self, work: Callable[[psycopg.AsyncConnection[Any]], Awaitable[T]]
    ) -> T:
        """Run ``work`` on a pool connection."""
        assert self._pool is not None
        async with self._pool.connection(timeout=_POOL_RECONNECT_S) as conn:
            return await work(conn)

    # -- the registry ----------------------------------------------------------------

    async def _housekeeping(self) -> None:
        """The registry: the built-in endpoints recorded as configured, then read whole at
        start and every HOUSEKEEPING_S (with the partitioned outbox's pending start); stuck
        ordered streams and deliveries parked on an enabled endpoint swept every SWEEP_S."""
        synced = False
        last_sweep = time.monotonic()
        refused = logs.Notice(60.0)  # a missing privilege: said once a minute
        while True:
            try:
                try:
                    if not synced:
                        await self.with_connection(self._sync_builtins)
                        synced = True
                    else:
                        await self.with_connection(self._restore_builtins)
                except psycopg.errors.ReadOnlySqlTransaction:
                    # A standby, a server switched read-only: the registry is read all the
                    # same (the claim loops say that the database refuses writes).
                    pass
                await self.with_connection(self.targets.load_all)
                await self.close_unused_tls_clients()
                self.claim_since = await self.with_connection(partitions.pending_since)
                if time.monotonic() - last_sweep >= SWEEP_S:
                    last_sweep = time.monotonic()
                    try:
                        if await self.with_connection(_sweep):
                            self._waker.wake_all()
                    except psycopg.Error as exc:  # not the registry's: said as what it is
                        log.warning(
                            "the sweep failed (%s); next in %.0fs", type(exc).__name__, SWEEP_S
                        )
            except asyncio.CancelledError:
                raise
            except psycopg.errors.InsufficientPrivilege as exc:
                # Not passing: the operator's to grant. Said at most once a minute.
                if refused.due() is not None:
                    log.error(
                        "registry not read (%s): the dispatcher's role needs the privileges"
                        ' of docs/operations.md, "Roles and privileges"; next try soon',
                        described(exc),
                    )
                await asyncio.sleep(1.0)
                continue
            except Exception as exc:
                log.debug("registry not read (%s); next try soon", type(exc).__name__)
                await asyncio.sleep(1.0)
                continue
            await asyncio.sleep(HOUSEKEEPING_S if self.targets.loaded else 1.0)

    def _builtins(self) -> tuple[tuple[str, str | None], ...]:
        """The built-in endpoints and their URLs as this dispatcher configures them."""
        return (
            (endpoints.DEFAULT_ID, self.settings.webhook_url or None),
            (endpoints.OPERATOR_ID, self.settings.operator_url or None),
        )

    async def _sync_builtins(self, conn: psycopg.AsyncConnection[Any]) -> None:
        for endpoint_id, url in self._builtins():
            if await endpoints.sync_builtin(conn, endpoint_id, url):
                self._log_retired(endpoint_id)

    async def _restore_builtins(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Every housekeeping period: the built-in endpoints this dispatcher configures are
        said to be configured (endpoints.seen_builtin), and put back if they are missing
        (removed by a dispatcher without the variable that started while none configuring
        them was seen: otherwise deliveries to them would wait and operator events would
        stop until this dispatcher restarts). Those it does not configure are removed only
        at a start (sync_builtin), never here: a running dispatcher would otherwise remove
        them whenever the hosts that configure them were away for a while (a stop-then-start
        deploy, a crash loop), and the default tenant's events routed then never reach
        `default`."""
        for endpoint_id, url in self._builtins():
            if not url:
                continue
            await endpoints.seen_builtin(conn, endpoint_id)
            if await endpoints.restore_builtin(conn, endpoint_id, url):
                log.warning(
                    "the built-in endpoint %s was missing; put back as this dispatcher "
                    "configures it (%s)",
                    endpoint_id,
                    _builtin_variable(endpoint_id),
                )

    @staticmethod
    def _log_retired(endpoint_id: str) -> None:
        log.warning(
            "the built-in endpoint %s was removed: no running dispatcher has %s set; its "
            "pending deliveries wait for one that has",
            endpoint_id,
            _builtin_variable(endpoint_id),
        )

    async def _reload(self, endpoint_id: str) -> None:
        try:
            await self.with_connection(lambda conn: self.targets.reload(conn, endpoint_id))
        except Exception as exc:  # the periodic reload catches up
            log.debug("endpoint %s not reloaded (%s)", endpoint_id, type(exc).__name__)
        self._waker.wake_all()  # an endpoint enabled again has due rows now

    # -- wake-ups --------------------------------------------------------------------

    async def _listen(self) -> None:
        backoff = 0.1
        failed = 0  # connections lost or refused in a row: the first is a warning
        reloads: set[asyncio.Task[None]] = set()
        while not self.stopping:
            try:
                async with await psycopg.AsyncConnection.connect(
                    self.conninfo, autocommit=True, **session_name(self.conninfo, APPLICATION_NAME)
                ) as conn:
                    await conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
                    await conn.execute(f"LISTEN {ENDPOINTS_CHANNEL}")
                    backoff = 0.1
                    if failed:
                        log.info("LISTEN connection back (%d attempt(s) failed)", failed)
                        failed = 0
                    self._waker.wake_all()  # anything committed while we were not listening
                    async for notify in conn.notifies():
                        if notify.channel == ENDPOINTS_CHANNEL:
                            task = asyncio.create_task(self._reload(notify.payload))
                            reloads.add(task)
                            task.add_done_callback(reloads.discard)
                        else:
                            self._waker.wake()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self.stopping:
                    return
                if isinstance(exc, psycopg.errors.ReadOnlySqlTransaction):
                    # A standby refuses LISTEN: the claim loops say the database is
                    # read-only (once); this listener tries again with its back-off.
                    log.debug("LISTEN refused by a read-only database; trying again")
                elif failed:  # said once per outage; the claim loops say theirs
                    log.debug("LISTEN reconnect failed (%s)", type(exc).__name__)
                else:
                    log.warning("LISTEN connection lost (%s); reconnecting", type(exc).__name__)
                failed += 1
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX_S)

    # -- claim loops -----------------------------------------------------------------

    async def _claim_loop(self, index: int) -> None:
        assert self._pool is not None
        backoff = 0.05
        failed = 0  # claims failed in a row (said once the loop claims again)
        failing_since = 0.0
        while not self.stopping:
            # A loop's position, from the start on a new connection.
            resume = Resume(front=self.claim_front)
            try:
                conn = await self._unless_stopping(self._pool.getconn(timeout=_POOL_RECONNECT_S))
                if conn is None:
                    return
                try:
                    while not self.stopping:
                        claimed, next_due = await self._run_batch(conn, resume)
                        backoff = 0.05
                        if failed:  # after an outage, a failover: said at INFO, once
                            log.info(
                                "claim loop %d: claiming again (%d claim(s) failed in %.1fs)",
                                index,
                                failed,
                                time.monotonic() - failing_since,
                            )
                            failed = 0
                        if self.read_only is not None:
                            log.info("the database accepts writes again; claiming")
                            self.read_only = None
                        if claimed >= self.settings.batch_size:
                            self._waker.wake()  # more may be due: let an idle loop help
                            continue
                        if claimed:
                            continue  # a partial batch: claim once more before sleeping
                        await self._waker.wait(self._sleep_s(next_due))
                except psycopg.errors.ReadOnlySqlTransaction:
                    await self._found_read_only(conn)
                    raise
                finally:
                    await self._pool.putconn(conn)
            except asyncio.CancelledError:
                raise
            except psycopg.errors.ReadOnlySqlTransaction:
                metrics.CLAIM_ERRORS.inc()  # logged once by _found_read_only
            except REFUSED_ERRORS as exc:
                metrics.CLAIM_ERRORS.inc()
                log.error("claim loop %d: claim refused (%s); retrying", index, exc.sqlstate)
            except psycopg.errors.InsufficientPrivilege as exc:
                metrics.CLAIM_ERRORS.inc()
                log.error(
                    "claim loop %d: %s; retrying (the dispatcher's role needs the privileges"
                    ' of docs/operations.md, "Roles and privileges")',
                    index,
                    described(exc),
                )
            except DB_ERRORS as exc:
                metrics.CLAIM_ERRORS.inc()
                if self.stopping:
                    return
                log.warning(
                    "claim loop %d: %s; retrying in %.2fs", index, _claim_failure(exc), backoff
                )
            except Exception:
                metrics.CLAIM_ERRORS.inc()
                log.exception("claim loop %d: unexpected error; retrying", index)
            if not failed:
                failing_since = time.monotonic()
            failed += 1
            # Jittered, and capped after the jitter: once a standby is promoted, every loop
            # must be claiming again within seconds however long the outage was.
            await self._unless_stopping(
                asyncio.sleep(min(backoff * (1 + random.random()), _BACKOFF_MAX_S))
            )
            backoff = min(backoff * 2, _BACKOFF_MAX_S)

    async def _found_read_only(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """A claim refused as a write on a read-only database: a standby (a URL naming a
        replica, or a failover that left the pool's connections on the old primary's
        standby) or a server switched to read-only. Logged once until a claim succeeds
        (each loop retries with its back-off); the connection is closed, so the pool opens
        another, which a multi-host URL with target_session_attrs leads to the primary."""
        why = "it refused a write"
        with contextlib.suppress(psycopg.Error):
            why = await read_only_reason(conn) or why
        await discard(conn)
        if self.read_only is None:
            log.warning(
                "the database is read-only (%s): nothing is claimed until it accepts writes; %s",
                why,
                READ_ONLY_HINT,
            )
        self.read_only = why

    async def _unless_stopping(self, step: Awaitable[T]) -> T | None:
        """``step``'s result, or None as soon as :meth:`stop` is called (``step`` is then
        cancelled): a stop never waits for a pool connection or a back-off."""
        return await unless_stopping(step, self._stopping, late=self._put_back)

    async def _put_back(self, late: object) -> None:
        if isinstance(late, psycopg.AsyncConnection) and self._pool is not None:
            await self._pool.putconn(late)  # obtained just as the stop came

    def _sleep_s(self, next_due_ms: int | None) -> float:
        """How long an idle loop waits (a NOTIFY or a busy loop's wake-up cuts it short)."""
        # next_due_in_ms counts only rows due after the claim began (rows due before it are
        # claimed, or held by another loop that completes them), so 0 means one became due
        # meanwhile: claim again at once. Nothing to spin on.
        poll = self.settings.poll_interval_ms
        wait = poll if next_due_ms is None else min(poll, next_due_ms + 1)
        return max(wait, 1) / 1000

    async def _run_batch(
        self, conn: psycopg.AsyncConnection[Any], resume: Resume
    ) -> tuple[int, int | None]:
        """One claim transaction (:class:`Batch`). Returns (rows claimed, ms until the next
        future due row)."""
        if not self.targets.loaded:
            await self.targets.load_all(conn)
        batch = Batch(self, resume)
        try:
            return await batch.run(conn)
        except psycopg.Error as exc:
            if outage(exc):
                self.after_rollback(batch)
                raise
            if not batch.completions and not batch.sends and not batch.route_failed:
                self.after_rollback(batch)
                raise  # nothing was sent: the claim itself failed
            log.error("batch completion failed (%s); completing row by row", described(exc))
            # The claim rolled back: rows it held that are not recorded again (deliveries of
            # a batch whose routing failed, rows not yet planned) are claimable again.
            self.claim_front.clear()
            try:
                batch.completions = await self.recorder.record_again(conn, batch)
            except BaseException:
                # Its one transaction rolled back too: nothing of the batch was written, so
                # its detached requests are given up (their rows are sent again), not left
                # waiting for a commit.
                self.after_rollback(batch)
                raise
            self.after_commit(batch)
            return batch.claimed, 0
        except BaseException:
            self.after_rollback(batch)
            raise

    # -- what a batch asks of its dispatcher -----------------------------------------

    def capacity_wait_s(self, target: Target) -> float | None:
        """None when ``target`` may take one more request of this process now; else how
        long to defer the row. An endpoint at its concurrency that answers quickly frees a
        slot within milliseconds: its rows come back after BUSY_DEFER_S. A slow one (a
        request outlived its batch or timed out lately) frees one when a request ends:
        after the time its requests take (Load.expected_s), at the latest at that
        request's timeout: its rows wait that long and take no claim capacity meanwhile.
        They come back no faster than it can take them (:meth:`_paced`)."""
        load = target.load
        if load.in_flight >= self.settings.endpoint_concurrency:
            if not load.slow:
                return BUSY_DEFER_S
            return self._paced(load, load.next_free_in_s(self.settings.timeout_ms / 1000))
        if self.connections_used() >= self.settings.max_connections:
            return 0.05
        if load.slow:
            return self.slow_share_wait_s(target)
        return None

    def _paced(self, load: Load, first_s: float, *, turns: Turns | None = None) -> float:
        """When a slow endpoint's row deferred now comes back: the first at ``first_s``,
        each later one a slot's share of its request time after the one before (its
        concurrency per request time, the rate at which it takes them; with ``turns``, the
        detached requests' share, paced by ``turns``), up to SLOW_HORIZON_TIMEOUTS
        timeouts ahead, and spread over that horizon beyond it: a hanging endpoint's
        backlog, all due at once, filled the claims ahead of the healthy endpoints' rows,
        each claimed only to be deferred again, and their latency grew with it. The
        horizon is in timeouts whatever the request time, so that a large backlog of an
        endpoint that answers in half a second is not claimed over and over either."""
        timeout_s = self.settings.timeout_ms / 1000
        slots = self.settings.endpoint_concurrency if turns is None else self._slow_share()
        return (turns or load.turns).next_in_s(
            max(first_s, BUSY_DEFER_S),
            step=load.expected_s(timeout_s) / slots,
            horizon=SLOW_HORIZON_TIMEOUTS * timeout_s,
        )

    def connections_used(self) -> int:
        """The requests in flight as WEBHOOK_MAX_CONNECTIONS counts them: the detached
        ones only up to their share (half). A request on the wire is never given up, so
        the first requests of endpoints that start hanging all at once may take the
        detached past their share; the requests of the batches keep their half."""
        over = self.completer.outstanding - self._slow_share()
        return self._in_flight - max(0, over)

    def _slow_share(self) -> int:
        return max(1, self.settings.max_connections // 2)

    def slow_share_wait_s(self, target: Target) -> float | None:
        """None while the requests that outlived their batch hold less than half of the
        process's connections (their share: they never take it all); else how long to
        defer a row of ``target``, a slow endpoint: from when the first of them is expected
        to end (after its endpoint's request time, at its timeout at the latest), paced as
        the share frees (:meth:`_paced`: its size per ``target``'s request time), so that
        many slow endpoints' backlogs are not claimed over and over only to be deferred
        again, and an endpoint that answers in half a second gets its rows back in about
        that long."""
        if self.completer.outstanding < self._slow_share():
            return None
        first = self.completer.next_end_in_s(self.settings.timeout_ms / 1000)
        return self._paced(target.load, first, turns=self._share_turns)

    def deferred_slow(self, target: Target, row_id: int, partition_at: datetime | None) -> None:
        """A slow endpoint's row was deferred: remembered (Load.early) to be made due again
        at the first answer that tells how long it was to wait: its endpoint's, when it has
        answered none yet; and while the detached requests hold their share, that of an
        endpoint one of them goes to that has answered none, whose end was guessed at its
        timeout (a burst to several slow endpoints: one that has answered would otherwise
        have its rows wait a timeout behind another's first request)."""
        target.load.deferred(row_id, partition_at)
        if self.completer.outstanding >= self._slow_share():
            unanswered = self.completer.unanswered()
            if unanswered is not None:
                unanswered.deferred(row_id, partition_at)

    def may_wait_for_slot(self, target: Target) -> bool:
        """Whether a row for ``target``, whose slots are all taken, waits in this process for
        the next one rather than going back to the outbox: yes for an endpoint that answers
        quickly (not slow) while the process is below WEBHOOK_MAX_CONNECTIONS, up to as
        many waiting rows as the claim loops can hold."""
        load = target.load
        settings = self.settings
        return (
            not load.detached_at_once  # neither slow nor suspect: its slots free quickly
            and load.in_flight >= settings.endpoint_concurrency
            and self.connections_used() < settings.max_connections
            and load.queued < settings.claim_loops * settings.batch_size
        )

    async def admit(self, candidates: Sequence[tuple[Claimed, Target]]) -> list[Admission]:
        """The gate's decisions for these rows: one call for all their URLs (one Redis
        round trip on a single node)."""
        if not candidates:
            return []
        groups: dict[str, list[int]] = {}
        for i, (_, target) in enumerate(candidates):
            groups.setdefault(target.url, []).append(i)
        out: list[Admission] = [ALLOW] * len(candidates)
        requests = []
        for url, indexes in groups.items():
            # The gate treats attempt numbers above 1 as retries; a replay counts as one.
            attempts = [
                max(candidates[i][0].attempt, 2) if candidates[i][0].is_retry else 1
                for i in indexes
            ]
            requests.append(AdmitRequest(url, attempts, candidates[indexes[0]][1].rate_limit))
        try:
            decided = await self.gate.admit_many(requests)
        except Exception:
            log.exception("delivery gate failed; admitting the batch (fail open)")
            metrics.REDIS_FAIL_OPEN.labels("gate").inc()
            return out
        if len(decided) != len(requests) or any(
            len(d) != len(r.attempts) for d, r in zip(decided, requests, strict=False)
        ):
            log.error("delivery gate answered decisions that do not match the rows; ignored")
            return out
        for indexes, admissions in zip(groups.values(), decided, strict=True):
            for i, admission in zip(indexes, admissions, strict=True):
                out[i] = admission
        return out

    async def send(self, send: Send) -> AttemptResult:
        """POST one row to its endpoint (its slot was reserved by the batch). A request that
        the batch detached is handed to the completer once the lease is committed."""
        row, target = send.row, send.target
        load = target.load
        if send.queued:
            # The request's timeout starts once it has its slot.
            await load.acquire(self.settings.endpoint_concurrency)
            committed = send.committed  # made with the lease
            if committed is not None and (
                self.stopping or (committed.is_set() and not send.lease_written)
            ):
                # Its batch has left it and this process stops: sent now, it could outlive
                # the drain (each request ahead of it may take its whole timeout) and be
                # recorded by nobody. Not sent; its row is due again at once. Or its batch
                # rolled back: the row is another claim's to send.
                load.release()
                await self._hand_over(send, None)
                return NOT_SENT
        send.started = True
        send.started_at = time.monotonic()
        load.starts.append(send.started_at)
        self._in_flight += 1
        if send.lease is not None:
            # Left its batch before it started (detached at once, or while it waited for a
            # slot): no batch shows it running.
            self.show_in_flight()
        # Whether no batch shows the count after this request: it outlived its batch, or
        # it was cancelled (its batch rolled back, or the process stops).
        unseen = True
        try:
            result = await self._attempt(row, target)
            unseen = send.lease is not None
        finally:
            self._in_flight -= 1
            load.release()
            with contextlib.suppress(ValueError):
                load.starts.remove(send.started_at)
            if unseen:
                self.show_in_flight()
        timed_out = result.error == "timeout"
        if timed_out or result.status is not None:
            load.ended(self.settings.timeout_ms / 1000 if timed_out else result.duration_ms / 1000)
            if load.early and not timed_out:
                self._bring_forward(load)
        if result.kind is Kind.DELIVERED and result.duration_ms < 1000 * PATIENCE_S:
            load.answered_fast()
        elif timed_out:
            load.mark_slow()
        metrics.ATTEMPT_DURATION.observe(result.duration_ms / 1000)
        if send.lease is not None:
            await self._hand_over(send, result)
        return result

    async def _hand_over(self, send: Send, result: AttemptResult | None) -> None:
        """A request that outlived its batch (``result`` None: not sent) goes to the
        completer once its batch's commit wrote the lease; if the batch rolled back, the
        row is claimed again and nothing is recorded."""
        assert send.committed is not None  # made with the lease
        await send.committed.wait()
        if send.lease_written:
            self.completer.submit(send, result)
        else:
            self.completer.settled([send])

    def _bring_forward(self, load: Load) -> None:
        """The endpoint's first request was answered: its rows deferred before, each
        waiting as if its requests ran to their timeout, are due now (on a connection of
        their own, beside the batches). The turns they were paced by (a timeout's share
        each) are void: the rows deferred from now on are paced by its answers."""
        rows, load.early = load.early, {}
        load.turns.next = self._share_turns.next = 0.0
        self._forward(rows, "deferred rows")

    def _forward(self, rows: Mapping[int, datetime | None], what: str) -> None:
        """Make ``rows`` (id: partition_at) that are still deferred due now, FORWARD_CHUNK
        per statement, on a connection of their own beside the batches."""
        if not rows:
            return
        items = list(rows.items())

        async def forward() -> None:
            async def work(conn: psycopg.AsyncConnection[Any]) -> int:
                done = 0
                for first in range(0, len(items), FORWARD_CHUNK):
                    async with conn.transaction():
                        chunk = dict(items[first : first + FORWARD_CHUNK])
                        done += await bring_forward(conn, chunk)
                return done

            try:
                if await self.with_connection(work):
                    self._waker.wake_all()
            except Exception as exc:  # they come back at their deferral as they would have
                log.debug("%s not brought forward (%s)", what, type(exc).__name__)

        task = asyncio.create_task(forward(), name="fluxora-bring-forward")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _attempt(self, row: Claimed, target: Target) -> AttemptResult:
        tracer = self.tracer
        span: Any = None
        result: AttemptResult | None = None
        try:
            headers = target.signer.headers(
                delivery_id=row.delivery_id,
                event_type=row.event_type,
                attempt=row.attempt,
                body=row.body,
                timestamp=row.timestamp,
            )
            if target.headers:
                headers = {**target.headers, **headers}
            if tracer is not None:
                span = tracer.start(row, target, headers)
            elif row.traceparent is not None:
                headers.update(passthrough(row.traceparent, row.tracestate))
            result = await attempt(
                self._client_for(target),
                target.url,
                row.body,
                headers,
                timeout_s=self.settings.timeout_ms / 1000,
                max_response_bytes=self.settings.max_response_bytes,
                clock=self._clock,
                secrets=target.secret_texts,
            )
            if target.tls is not None and _after_tls_began(result):
                result = _certificate_validity_said(result, target.tls)
        except Exception as exc:  # one bad row never takes the batch down
            log.exception("delivery %s: unexpected error building the attempt", row.delivery_id)
            result = AttemptResult(
                Kind.PERMANENT,
                error=f"internal error: {type(exc).__name__}",
                reason="internal_error",
            )
        finally:
            if span is not None and tracer is not None:
                tracer.end(span, result, self._span_outcome(row, target, result))
        return result

    def _span_outcome(self, row: Claimed, target: Target, result: AttemptResult | None) -> str:
        """What the attempt will be recorded as (the policy's decision, see batch.outcome_of),
        for its span: ``cancelled`` when the request was abandoned."""
        if result is None:
            return "cancelled"
        if result.reason in HELD:
            return Outcome.DEFERRED.value  # batch.outcome_of
        if gone_retried(self.policy, row, target, result):
            return Outcome.RETRY.value  # its next attempt parked (batch.outcome_of)
        if result.kind is Kind.DELIVERED:
            return Outcome.DELIVERED.value
        if result.kind is Kind.RETRYABLE and not self.policy.exhausted(row.attempt):
            return Outcome.RETRY.value
        return Outcome.DEAD_LETTER.value

    def _client_for(self, target: Target) -> HttpClient:
        """The built-in endpoints' URLs are the operator's own (an explicit loopback URL is
        allowed); registered endpoints go through the strict address policy. Plain http
        goes to loopback addresses only."""
        if self._given_client is not None:
            return self._given_client
        key = self._policy_keys.get((target.builtin, target.url))
        if key is None:  # parsed once per URL, not per request
            rule = loopback_rule(target.url)
            key = (target.builtin, target.builtin and rule.allow, rule.require)
            if len(self._policy_keys) >= _POLICY_KEYS_MAX:
                self._policy_keys.clear()
            self._policy_keys[(target.builtin, target.url)] = key
        if target.tls is not None:
            return self._tls_client_for(key, target.tls)
        client = self._clients.get(key)
        if client is None:
            client = self._clients[key] = make_client(
                self.settings,
                allow_loopback=key[1],
                require_loopback=key[2],
                resolving=self.resolving,
            )
        return client

    def _tls_client_for(self, key: tuple[bool, bool, bool], tls: ClientTls) -> HttpClient:
        """The client of an endpoint with its own client certificate: the address policy's,
        presenting that certificate (in place of WEBHOOK_TLS_CLIENT_CERT's). Its keep-alive
        connections are its own: one made with another certificate, or with none, is never
        reused for it."""
        client = self._tls_clients.get((key, tls.fingerprint))
        if client is None:
            client = self._tls_clients[(key, tls.fingerprint)] = make_client(
                self.settings,
                allow_loopback=key[1],
                require_loopback=key[2],
                ssl_context=tls.context,
                resolving=self.resolving,
            )
        return client

    async def close_unused_tls_clients(self) -> None:
        """Close the clients of client certificates no endpoint presents any more (one
        replaced, its endpoint removed): their idle connections too."""
        used = {t.tls.fingerprint for t in self.targets.all() if t.tls is not None}
        for key in [k for k in self._tls_clients if k[1] not in used]:
            await self._tls_clients.pop(key).close()

    async def report(self, reports: Mapping[str, Sequence[tuple[Admission, Signal]]]) -> None:
        """Tell the gate how the admitted attempts went, per URL."""

        async def one(url: str, results: Sequence[tuple[Admission, Signal]]) -> None:
            try:
                await self.gate.report(url, results)
            except Exception:  # the gate fails open; a broken one must not undo the batch
                log.exception("delivery gate report failed; ignored")

        await asyncio.gather(*(one(url, results) for url, results in reports.items()))

    def report_later(self, reports: Mapping[str, Sequence[tuple[Admission, Signal]]]) -> None:
        """:meth:`report` in a task of its own: the gate's reports wait for a connection of
        theirs (redis_gate.GATE_CONNECTIONS), and nothing that records attempts waits
        for them."""
        if reports:
            task = asyncio.ensure_future(self.report(reports))
            task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)

    def commit_started(self, batch: Batch) -> None:
        self._committing[id(batch)] = time.monotonic()

    def commit_ended(self, batch: Batch) -> None:
        self._committing.pop(id(batch), None)

    def commit_wait_s(self) -> float:
        """How long the oldest COMMIT of a batch with rows has been waiting (0: none is).
        A commit that does not come back (a synchronous standby that does not answer, a
        full disk) stops every claim loop that reaches one, with nothing failing."""
        if not self._committing:
            return 0.0
        return time.monotonic() - min(self._committing.values())

    def after_commit(self, batch: Batch) -> None:
        """The batch's transaction committed (or its rows were recorded one by one)."""
        self.batches += 1
        for send in batch.sends:
            if send.committed is not None:  # made with its lease
                send.lease_written = True
                send.committed.set()
        reports: dict[str, list[tuple[Admission, Signal]]] = {}
        # Counted once per outcome and batch: a counter's increment is a lock (and under
        # the supervisor a write to its file), not worth paying per row.
        tally: collections.Counter[tuple[Outcome, str | None]] = collections.Counter()
        for send, result, decision in batch.done:
            reports.setdefault(send.target.url, []).append((send.admission, breaker_signal(result)))
            if decision.outcome is not Outcome.DEFERRED:  # counted with the completions below
                tally[decision.outcome, decision.reason] += 1
        # Rows handled without an attempt of this batch; LEASED: a request that outlived
        # the batch (one completion each, written with its lease by this commit; its
        # attempt's outcome counts again when the completer records it).
        for completion in batch.completions:
            if completion.outcome in (
                Outcome.DEFERRED,
                Outcome.PARKED,
                Outcome.ROUTED,
                Outcome.LEASED,
            ):
                tally[completion.outcome, None] += 1
        unrouted = min(batch.unrouted, tally[Outcome.ROUTED, None])
        if unrouted:  # event rows that matched no endpoint: counted apart
            tally[Outcome.ROUTED, None] -= unrouted
            tally[Outcome.UNROUTED, None] += unrouted
        for (outcome, reason), n in tally.items():
            self.count(outcome, reason, n)
        self.report_later(reports)
        if batch.promoted:
            self._waker.wake()

    def promote_busy(self, pairs: Sequence[tuple[str, str]]) -> None:
        """After a commit: choose the next heads of the ordered streams whose lock another
        transaction held when this one chose them (migration 0011), or past the
        transaction's MAX_STREAM_LOCKS, in a task of their own on one pool connection,
        in transactions that hold nothing else; that holder's own choice is committed by
        then. The claim loop goes on meanwhile (the holder's batch may last as long as its
        requests). One such task at a time, taking every stream handed over meanwhile:
        one per batch held the pool's connections waiting for streams' locks (batches of
        100 events to ten ordered endpoints), and a batch's detached attempts then found
        none to be recorded with and were sent again. Should it fail, or the dispatcher
        stop first, the sweep chooses them."""
        if not pairs:
            return
        self._busy_streams.update(pairs)
        if self._promoter is None or self._promoter.done():
            task = asyncio.ensure_future(self._promote_busy())
            self._promoter = task
            self._promotions.add(task)
            task.add_done_callback(self._promotions.discard)

    async def _promote_busy(self) -> None:
        from .outbox import promote_handed_over

        while self._busy_streams:
            pairs = list(self._busy_streams)  # promote_handed_over puts them in key order
            self._busy_streams.clear()
            try:
                promoted = await self.with_connection(
                    functools.partial(promote_handed_over, pairs=pairs)
                )
            except Exception as exc:
                log.warning(
                    "choosing the next head of %d ordered stream(s) failed (%s); the sweep will",
                    len(pairs),
                    type(exc).__name__,
                )
                continue
            if promoted:
                self._waker.wake()

    def show_in_flight(self) -> None:
        """Set the in-flight gauge: after each batch's requests (those still running have
        left it) and as each request that outlived its batch ends, rather than at every
        request's start and end (a gauge's change is a lock, and under the supervisor a
        write to its file). The last change of the count is always followed by one."""
        metrics.IN_FLIGHT.set(self._in_flight)

    def after_rollback(self, batch: Batch) -> None:
        """The batch's transaction rolled back: its leases were never written, so its
        detached requests are not recorded (their rows are claimed and sent again), and its
        rows are claimable again before the loops' front."""
        self.claim_front.clear()
        for send in batch.sends:
            if send.committed is not None:
                send.committed.set()
            if send.task is None:
                if not send.queued and not send.withheld:  # a withheld one gave it back
                    send.target.load.release()  # reserved, never sent
            elif send.lease is None and not send.task.done():
                send.task.cancel()

    def count(self, outcome: Outcome, reason: str | None, n: int = 1) -> None:
        if outcome is Outcome.DEAD_LETTER:
            metrics.DEAD_LETTERS.labels(reason or "unknown").inc(n)
        self._outcome[outcome].inc(n)

    def log_decision(
        self, row: Claimed, target: Target, result: AttemptResult, decision: Decision
    ) -> None:
        if decision.outcome is Outcome.DEFERRED:  # held at the proxy or for the resolver
            (self._egress_said if result.reason == EGRESS else self._resolver_said).held(
                result.error
            )
            return
        ended = self.resolving.ended  # per attempt: one attribute read
        if ended is not None:  # a lookup got an answer: the resolver is back
            self.resolving.take_ended()
            self._holds_ended(self.resolving.hold, ended, "DNS lookups work again (they")
        if self.egress.since is not None and target.url.startswith("https:"):
            ended = self.egress.answered()  # a request through the proxy got an answer
            if ended is not None:
                self._holds_ended(self.egress, ended, "the egress proxy works again (it")
        if decision.outcome is not Outcome.RETRY:
            metrics.ATTEMPTS_PER_DELIVERY.observe(row.attempt)
        if decision.outcome is Outcome.DELIVERED:
            if log.isEnabledFor(logging.DEBUG):  # the fields are built only when logged
                log.debug("delivered", extra=_log_fields(row, target, result, decision))
        elif decision.reason == "gone":
            log.info(
                "delivery %s attempt %d: 410 Gone; the endpoint is disabled, the next"
                " attempt parked",
                row.delivery_id,
                row.attempt,
                extra=_log_fields(row, target, result, decision),
            )
        elif decision.outcome is Outcome.RETRY:
            log.info(
                "delivery %s attempt %d failed (%s); retry in %.1fs",
                row.delivery_id,
                row.attempt,
                result.error or result.status,
                decision.delay_ms / 1000,
                extra=_log_fields(row, target, result, decision),
            )
        else:
            log.warning(
                "delivery %s goes to the dead letters after attempt %d: %s (%s)",
                row.delivery_id,
                row.attempt,
                decision.reason,
                result.error or result.status,
                extra=_log_fields(row, target, result, decision),
            )

    def _holds_ended(self, hold: EgressHold, ended: tuple[float, float], what: str) -> None:
        """An outage of the egress proxy or the resolver ended (``ended``: how long it
        failed, the longest hold given): the rows this process held are due at once."""
        failed_s, longest_s = ended
        held = hold.take_held()
        log.warning(
            "%s failed for %ds); the %d delivery(ies) this process held are due now, any"
            " others when their holds end, within %ds",
            what,
            round(failed_s),
            len(held),
            math.ceil(longest_s),
        )
        self._forward(held, "held rows")

    def note_disabled(self, endpoint_id: str, reason: str) -> None:
        metrics.ENDPOINTS_DISABLED.labels(reason=reason).inc()
        log.warning("endpoint %s disabled (%s); its deliveries are parked", endpoint_id, reason)

    def warn_unconfigured(self, endpoint_id: str) -> None:
        if endpoint_id not in self._warned:
            self._warned.add(endpoint_id)
            log.warning(
                "deliveries to the built-in endpoint %s wait: this dispatcher has no %s",
                endpoint_id,
                _builtin_variable(endpoint_id),
            )


# What the dispatcher's sessions are called in pg_stat_activity (and the server's logs):
# an operator tells them from the producers' and the API's.
APPLICATION_NAME = "fluxora-webhooks dispatcher"


def _claim_failure(exc: BaseException) -> str:
    """What stopped a claim, for its log line. A lock not granted in time or a cancelled
    statement is a database that answers: an operator's VACUUM FULL, CLUSTER, ALTER TABLE,
    TRUNCATE or LOCK TABLE of the outbox (each takes an ACCESS EXCLUSIVE lock), not an
    outage."""
    if isinstance(exc, psycopg.errors.LockNotAvailable):
        return (
            f"a lock the claim needs was not granted within {LOCK_TIMEOUT_MS / 1000:g} s"
            " (LockNotAvailable): another session holds the outbox, such as an operator's"
            " VACUUM FULL, CLUSTER, REINDEX (not CONCURRENTLY), ALTER TABLE, TRUNCATE or"
            " LOCK TABLE; deliveries wait until it commits (pg_locks names it)"
        )
    if isinstance(exc, psycopg.errors.QueryCanceled):
        return (
            "a statement was cancelled (QueryCanceled: its statement_timeout of"
            f" {STATEMENT_TIMEOUT_MS / 1000:g} s, or an operator's pg_cancel_backend)"
        )
    return f"database unavailable ({type(exc).__name__})"


def _builtin_variable(endpoint_id: str) -> str:
    """The variable that configures a built-in endpoint's URL."""
    return "WEBHOOK_URL" if endpoint_id == endpoints.DEFAULT_ID else "WEBHOOK_OPERATOR_URL"


# The streams of one page of stuck_streams, and how many pages one sweep takes at most.
STUCK_PAGE = 1000
SWEEP_PAGES = 10


async def _sweep(conn: psycopg.AsyncConnection[Any]) -> int:
    """One dispatcher at a time (a try-lock): ordered streams with a waiting delivery and
    no head get their head chosen, and deliveries parked on an endpoint enabled meanwhile
    are due again (endpoint_stragglers). Returns how many were found."""
    from .outbox import promote_heads
    from .queries import query

    cur = await conn.execute(query("sweep_lock"))
    row = await cur.fetchone()
    if not row or not row[0]:
        return 0
    try:
        promoted, after = 0, ("", "")
        # A page of streams at a time, in key order, each page's heads chosen in
        # transactions of their own (promote_heads on an idle connection), until a page is
        # short: thousands of streams left without heads (an enable whose choice failed)
        # wait one sweep, not one sweep per thousand; a stream whose head cannot be chosen
        # yet (an earlier event still to be routed) does not hold up the ones after it.
        for _ in range(SWEEP_PAGES):
            cur = await conn.execute(
                query("stuck_streams"),
                {"after_endpoint": after[0], "after_stream": after[1], "page": STUCK_PAGE},
            )
            pairs = [(str(e), str(s)) for e, s in await cur.fetchall()]
            promoted += await promote_heads(conn, pairs)
            if len(pairs) < STUCK_PAGE:
                break
            after = pairs[-1]
        # Deliveries parked on an endpoint enabled meanwhile (endpoint_stragglers).
        unparked = await endpoints.unpark_stragglers(conn)
        if unparked:
            log.info("deliveries parked on %d endpoint(s) enabled meanwhile are due", unparked)
        return promoted + unparked
    finally:
        await conn.execute(query("sweep_unlock"))


def _log_fields(
    row: Claimed, target: Target, result: AttemptResult, decision: Decision
) -> dict[str, Any]:
    """A delivery record's fields (logs.FIELDS): never its URL or a secret. ``tenant``: the
    event's (the endpoint's), None (absent) for the default tenant; ``reason``: the
    decision's (a dead letter's, ``gone``), None (absent) for the others."""
    return {
        "delivery_id": row.delivery_id,
        "event_type": _short_type(row.event_type),
        "attempt": row.attempt,
        "status": result.status,
        "duration_ms": round(result.duration_ms, 2),
        "endpoint_id": target.id,
        "tenant": row.tenant or target.tenant or None,
        "reason": decision.reason or None,
    }


def _short_type(event_type: str) -> str:
    """An event type as a log record holds it: whole up to MAX_EVENT_TYPE characters (what
    ``enqueue`` takes), cut past that (plain SQL takes any length: a record of 20,000)."""
    if len(event_type) <= MAX_EVENT_TYPE:
        return event_type
    return f"{event_type[:MAX_EVENT_TYPE]}... ({len(event_type)} characters)"


class _HeldSaid:
    """Attempts held on this service's side (batch.outcome_of: the egress proxy failed, or
    the DNS resolver): counted, and said at most every EGRESS_LOG_EVERY_S with how many
    since (an outage fails every request that goes its way). ``words`` take the last
    attempt's error, the count and the probe's interval."""

    def __init__(self, counter: Any, words: str) -> None:
        self._counter = counter
        self._words = words
        self._since_said = 0
        self._said_at = -EGRESS_LOG_EVERY_S

    def held(self, error: str | None) -> None:
        self._counter.inc()
        self._since_said += 1
        now = time.monotonic()
        if now - self._said_at < EGRESS_LOG_EVERY_S:
            return
        self._said_at = now
        log.warning(self._words, error, self._since_said, egress.PROBE_S)
        self._since_said = 0


def make_client(
    settings: Settings,
    *,
    allow_loopback: bool = False,
    require_loopback: bool = False,
    ssl_context: ssl.SSLContext | None = None,
    resolving: ResolverWatch | None = None,
) -> HttpClient:
    """The HTTP client: keep-alive, the connect-time address policy (resolved addresses are
    checked and the connection is pinned to them). ``allow_loopback``: an operator's own
    loopback URL (a built-in endpoint); ``require_loopback``: plain http, which may go only
    to loopback addresses whatever the name resolves to. Our own limits (per endpoint, and
    WEBHOOK_MAX_CONNECTIONS in all) defer rows instead of queueing them in the client,
    where the wait would eat into the request's timeout. ``ssl_context``: an endpoint's own
    (its client certificate), in place of the deployment's."""
    resolver = SafeResolver(
        allow_loopback,
        settings.allowed_networks,
        require_loopback=require_loopback,
    )
    context = ssl_context
    if context is None and settings.tls_client_cert is not None:
        context = client_ssl_context(settings.tls_client_cert, settings.tls_client_key)
    return HttpClient(
        resolver,
        ssl_context=context,
        proxy=settings.proxy,
        no_proxy=settings.no_proxy,
        resolving=resolving,
    )


def _after_tls_began(result: AttemptResult) -> bool:
    """Whether an attempt with no HTTP answer failed once TLS had begun (its handshake, or
    the first read after it, when TLS 1.3 refuses a client certificate), where a consumer
    refuses a certificate: not a connection refused or unreachable, which never got
    there."""
    if result.reason == "network_error":
        return True
    return result.reason == "connection_error" and "TLS" in (result.error or "")


def _certificate_validity_said(result: AttemptResult, tls: ClientTls) -> AttemptResult:
    """An attempt with no HTTP answer from a consumer the endpoint presents an expired
    client certificate to, or one not valid yet: its error says so (a consumer that checks
    certificates ends the handshake with an alert that reads as a connection reset or a
    closed connection)."""
    found = validity(tls.not_before, tls.not_after)
    if found == EXPIRED and tls.not_after is not None:
        said = f" (its client certificate expired on {tls.not_after.isoformat()})"
    elif found == NOT_YET_VALID and tls.not_before is not None:
        said = f" (its client certificate is not valid before {tls.not_before.isoformat()})"
    else:
        return result
    return dataclasses.replace(result, error=(result.error or "") + said)
