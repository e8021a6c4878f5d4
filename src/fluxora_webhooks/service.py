"""``fluxora-webhooks run``: the dispatcher as a service.

Start-up: validated settings -> engines -> schema check -> Redis gate -> dispatcher and the
HTTP endpoint (``/metrics``, ``/healthz``, ``/readyz``), and the management API and
dashboard when ``WEBHOOK_API_PORT`` is set (uvicorn in this loop, its own signal handling
off). SIGTERM/SIGINT/SIGQUIT (:data:`STOP_SIGNALS`): stop claiming and stop the API (both
bounded, at the same time), let the in-flight batch finish (bounded by the request timeout
plus a grace period), close connections, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import psycopg
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from . import logs, metrics
from .dispatcher import APPLICATION_NAME, Dispatcher, unless_stopping
from .endpoints import BUILTIN_SEEN_S, DEFAULT_ID, OPERATOR_ID
from .errors import ConfigError, FluxoraError, SchemaError
from .gate import DeliveryGate, OpenGate
from .host import STOP_SIGNALS, early_stop, raise_open_files_limit, stopped_by
from .migrations import (
    READ_ONLY_HINT,
    check_dispatcher_privileges,
    check_schema,
    check_session_pooling,
    read_only_reason,
    unreachable_reason,
)
from .ops import (
    BACKLOG_COUNT_CAP,
    METRIC_ENDPOINTS,
    read_backlog,
    read_endpoint_health,
    set_backlog_gauges,
    set_endpoint_gauges,
)
from .pgtypes import open_session
from .queries import session_lock
from .redis_gate import gate_for
from .settings import Settings, cannot_listen, register_engine_secrets
from .telemetry import FLUSH_TIMEOUT_MS, AttemptTracer
from .telemetry import from_env as tracer_from_env

if TYPE_CHECKING:
    from .retention import PruneResult

log = logging.getLogger("fluxora_webhooks.service")

# At start-up, the longest pause between two attempts to reach the database.
STARTUP_RETRY_MAX_S = 5.0


async def serve_health(settings: Settings, **handlers: Any) -> tuple[web.AppRunner, int]:
    """Serve ``/metrics``, ``/healthz`` and ``/readyz`` (``handlers`` by name) on
    ``WEBHOOK_METRICS_HOST:WEBHOOK_METRICS_PORT``; returns the runner and the bound port. An
    address or port that cannot be listened on is a configuration error naming its
    variable."""
    app = web.Application()
    for name, handler in handlers.items():
        app.router.add_get(f"/{name}", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    host, port = settings.metrics_host, settings.metrics_port
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except (OSError, UnicodeError) as exc:
        await runner.cleanup()
        raise cannot_listen("METRICS", host, port, exc) from None
    server: Any = site._server
    bound = int(server.sockets[0].getsockname()[1])
    paths = ", ".join(f"/{name}" for name in handlers)
    log.info("%s on http://%s:%d", paths, host, bound)
    return runner, bound


def _curable_by_waiting(exc: psycopg.OperationalError) -> bool:
    """The server was not reached (refused, timed out, no route, no such host yet) or is
    starting, recovering or shutting down, as during a restart or a failover, or out of
    connection slots; not a refusal that waiting does not change (authentication, no such
    database or role). A failed connection carries no SQLSTATE, only the server's words,
    which are in its language (``lc_messages``, set for the server: a session cannot
    change it before it is let in): only the refusals that waiting does not change are
    recognised, in English, and any other is waited for, within WEBHOOK_STARTUP_WAIT_MS,
    its words logged at each attempt. (Recognising the passing refusals instead stopped a
    ``run`` at once beside a German server that was starting up or full.)"""
    if exc.sqlstate is not None:
        return exc.sqlstate.startswith("08") or exc.sqlstate in _CURABLE_STATES
    text = str(exc)
    return not any(words in text for words in _LASTING_REFUSALS)


# Starting, shutting down, crash recovery; out of connection slots (a reconnect storm
# after a failover): a refusal that passes.
_CURABLE_STATES = ("57P01", "57P02", "57P03", "53300")
# PostgreSQL's refusals of a connection that waiting does not change: authentication (any
# method: "password authentication failed for user", "Ident authentication failed for
# user", ...), pg_hba.conf, no such database or role, no CONNECT or LOGIN, a database that
# takes no connections (datallowconn), a setting of the URL's options refused; a pooler's
# no such database or user; and libpq's own (always English): TLS the server or the URL
# cannot do, a certificate, an option's value, a password or channel binding the URL lacks.
_LASTING_REFUSALS = (
    "authentication failed for user",
    "pg_hba.conf",
    "does not exist",
    "is not permitted to log in",
    "permission denied",
    "not currently accepting connections",
    "configuration parameter",
    "invalid value for parameter",
    "unsupported frontend protocol",
    "no such database",
    "no such user",
    "does not support SSL",
    "invalid sslmode",
    "invalid integer value",
    "certificate file",
    "certificate verify failed",
    "server certificate for",
    "root certificate file",
    "no password supplied",
    "channel binding",
)


# A batch's COMMIT waiting this long makes the process not ready: a commit takes
# milliseconds, tens of them to a synchronous standby in another zone.
COMMIT_STUCK_S = 10.0


def commits_stuck(wait_s: float) -> str | None:
    """/readyz's reason when a COMMIT has waited past COMMIT_STUCK_S (None: it has not)."""
    if wait_s < COMMIT_STUCK_S:
        return None
    return (
        f"a commit has waited {wait_s:.0f} s (the database does not complete commits:"
        " a synchronous standby that does not answer, a full disk?)"
    )


async def warn_if_wake_up_off(conn: psycopg.AsyncConnection[Any], poll_interval_ms: int) -> bool:
    """The producers' wake-up may be off for this database, or for a role, or this session
    (``fluxora.notify``, migration 0012): idle claim loops then find the events those
    producers write only at their poll, which had better be short. Returns whether it
    warned."""
    if poll_interval_ms <= 1000:
        return False
    cur = await conn.execute(_WAKE_UP_OFF)
    row = await cur.fetchone()
    if not (row and row[0]):
        return False
    log.warning(
        "%s for this database or one of its roles: idle claim loops find"
        " the events those producers write only at their poll, every %d ms"
        " (WEBHOOK_POLL_INTERVAL_MS); set it to 100-1000",
        row[0],
        poll_interval_ms,
    )
    return True


# The session's own setting, or one that ALTER DATABASE or ALTER ROLE (any role: the
# producers') gave this database or every database. session_replication_role = replica
# (set for a role that replicates or bulk-loads into the outbox) fires no trigger, the
# wake-up's either.
_WAKE_UP_OFF = """
WITH given AS (
    SELECT lower(replace(c, ' ', '')) AS c FROM pg_db_role_setting s, unnest(s.setconfig) c
    WHERE s.setdatabase IN (0, (SELECT oid FROM pg_database WHERE datname = current_database()))
)
SELECT CASE
    WHEN lower(coalesce(current_setting('fluxora.notify', true), '')) IN ('off', 'false', '0')
        OR EXISTS (SELECT 1 FROM given
                   WHERE c IN ('fluxora.notify=off', 'fluxora.notify=false', 'fluxora.notify=0'))
    THEN 'fluxora.notify is off'
    WHEN current_setting('session_replication_role') = 'replica'
        OR EXISTS (SELECT 1 FROM given WHERE c = 'session_replication_role=replica')
    THEN 'session_replication_role is replica (no trigger fires, the wake-up''s neither)'
END
"""


async def warn_if_not_vacuumed(conn: psycopg.AsyncConnection[Any]) -> bool:
    """Every delivery leaves a dead row version in the outbox (the claim's, the
    completion's): without autovacuum they are never reclaimed, each claim reads more of
    them, and deliveries slow down by the hour (a soak run at 50 events/s: the claim from
    0.1 to 50 ms and the commit-to-receipt p50 from 8 to 230 ms in 15 minutes). Says so
    when the server's autovacuum or the outbox's is off. Returns whether it warned."""
    cur = await conn.execute(_NOT_VACUUMED)
    row = await cur.fetchone()
    if row is None or not row[0]:
        return False
    log.warning(
        "autovacuum is off (%s): the outbox's dead row versions are never reclaimed, so every"
        " claim reads more of them and deliveries slow down hour by hour; turn it on, or run"
        " VACUUM webhook_outbox every few minutes",
        row[0],
    )
    return True


# Why the outbox is not vacuumed automatically ('' when it is): the server's setting (or
# the statistics autovacuum needs), or the storage parameter of the table or of any of its
# partitions (migrate --partitioned: the partitions are the tables that are vacuumed).
_NOT_VACUUMED = """
WITH off AS (
    SELECT c.relname::text AS name, c.oid = to_regclass('webhook_outbox') AS parent
    FROM pg_class c
    WHERE (c.oid = to_regclass('webhook_outbox')
           OR c.oid IN (SELECT relid FROM pg_partition_tree(to_regclass('webhook_outbox'))))
      AND EXISTS (
        SELECT 1 FROM unnest(c.reloptions) AS o(option)
        WHERE lower(replace(o.option, ' ', ''))
              IN ('autovacuum_enabled=false', 'autovacuum_enabled=off',
                  'autovacuum_enabled=0', 'autovacuum_enabled=no'))
)
SELECT concat_ws(', ',
    CASE WHEN current_setting('autovacuum') = 'off' THEN 'autovacuum = off' END,
    CASE WHEN current_setting('track_counts') = 'off' THEN 'track_counts = off' END,
    CASE WHEN EXISTS (SELECT 1 FROM off WHERE parent)
    THEN 'webhook_outbox has autovacuum_enabled = false' END,
    (SELECT format('%s partition(s) of webhook_outbox have autovacuum_enabled = false (%s)',
                   count(*), string_agg(name, ', ' ORDER BY name))
     FROM off WHERE NOT parent HAVING count(*) > 0))
"""


async def warn_if_nowhere_to_deliver(
    conn: psycopg.AsyncConnection[Any], settings: Settings
) -> bool:
    """SPEC 10: with neither ``WEBHOOK_URL`` nor a registered endpoint, ``run`` starts (an
    endpoint may be registered at any time) and says so. The built-in ``default`` that this
    start leaves in the registry (a run with WEBHOOK_URL seen within BUILTIN_SEEN_S, or a
    disabled one: endpoints.retire_builtin) is one: the default tenant's events go to it
    and wait, which it says instead. Returns whether it warned."""
    if settings.webhook_url:
        return False
    cur = await conn.execute(
        "SELECT EXISTS (SELECT 1 FROM webhook_endpoints WHERE id NOT IN (%s, %s)),"
        " EXISTS (SELECT 1 FROM webhook_endpoints WHERE id = %s AND (state <> 'enabled'"
        "  OR EXISTS (SELECT 1 FROM webhook_builtin_seen WHERE endpoint_id = %s"
        "   AND seen_at > now() - %s * interval '1 second')))",
        (DEFAULT_ID, OPERATOR_ID, DEFAULT_ID, DEFAULT_ID, BUILTIN_SEEN_S),
    )
    row = await cur.fetchone()
    if row is not None and row[0]:
        return False
    if row is not None and row[1]:
        log.warning(
            "WEBHOOK_URL is unset and no endpoint is registered but the built-in default:"
            " the default tenant's events go to it and wait until a run with WEBHOOK_URL is"
            " seen, or until a run without it removes it (one that starts when none with it"
            " has been seen for about a minute; never a disabled one); other tenants' events"
            " are recorded as unrouted until an endpoint is registered"
        )
        return True
    log.warning(
        "no endpoint to deliver to: WEBHOOK_URL is unset and no endpoint is registered"
        " (fluxora-webhooks endpoints add, or the API); events are recorded as unrouted"
        " until one is"
    )
    return True


async def wait_for_database(
    url: str, wait_ms: int, stopping: asyncio.Event
) -> psycopg.AsyncConnection[Any] | None:
    """At start-up: until the database accepts a connection, for up to ``wait_ms``
    (``WEBHOOK_STARTUP_WAIT_MS``), each failure logged, so a dispatcher started beside a
    database that is still starting (or failing over) waits for it instead of exiting.
    Returns that connection (autocommit), or None when a stop came first, also during an
    attempt (connect_timeout is 10 s); raises the last error once the time is up, or at
    once for a failure that waiting does not cure."""
    deadline = time.monotonic() + wait_ms / 1000
    pause = 0.5
    while True:
        try:
            conn = await _writable_connection(url, stopping)
        except psycopg.OperationalError as exc:
            left = deadline - time.monotonic()
            if not _curable_by_waiting(exc) or left <= 0:
                raise
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            log.warning(
                "database not reachable yet (%s); trying again for up to %.0f s more"
                " (WEBHOOK_STARTUP_WAIT_MS)",
                logs.scrub(reason),
                left,
            )
        except _ReadOnly as exc:
            # A standby (a failover not finished, or a URL naming a replica): every claim
            # would fail. Promotion cures it, so it is waited for like an absent server.
            left = deadline - time.monotonic()
            if left <= 0:
                raise FluxoraError(f"the database is read-only ({exc}): {READ_ONLY_HINT}") from None
            log.warning(
                "database is read-only (%s); trying again for up to %.0f s more"
                " (WEBHOOK_STARTUP_WAIT_MS): %s",
                exc,
                left,
                READ_ONLY_HINT,
            )
        else:
            return conn
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(min(pause, left)):
                await stopping.wait()
        if stopping.is_set():
            return None
        pause = min(pause * 2, STARTUP_RETRY_MAX_S)


async def _close(conn: psycopg.AsyncConnection[Any]) -> None:
    await conn.close()


class _ReadOnly(Exception):
    """The database answered and refuses writes (the message says why)."""


async def _writable_connection(
    url: str, stopping: asyncio.Event
) -> psycopg.AsyncConnection[Any] | None:
    """One connection attempt (autocommit) to a database that accepts writes; None when a
    stop came first. Raises psycopg's error, or :class:`_ReadOnly`; no connection is left
    open but the one returned."""
    conn = await unless_stopping(
        open_session(url, name=APPLICATION_NAME, autocommit=True, connect_timeout=10),
        stopping,
        late=_close,
    )
    if conn is None:
        return None
    try:
        why = await unless_stopping(read_only_reason(conn), stopping)
        if why is not None:
            raise _ReadOnly(why)
    except BaseException:
        await conn.close()
        raise
    if stopping.is_set():
        await conn.close()
        return None
    return conn


DRAIN_GRACE_S = 5.0
GAUGE_REFRESH_S = 5.0
# The reading of the endpoints' health for the per-endpoint series gives up after this.
ENDPOINT_READING_TIMEOUT_MS = 3_000
# With WEBHOOK_RETENTION set: a prune at start-up, then one per interval.
RETENTION_INTERVAL_S = 600.0
# A partitioned outbox's partitions ahead are checked this often (they last intervals).
PARTITIONS_INTERVAL_S = 600.0
RETENTION_BATCH_SIZE = 2000
RETENTION_PAUSE_S = 0.05


class Service:
    def __init__(
        self,
        settings: Settings,
        *,
        database_url: str,
        redis_url: str | None,
        clock: Callable[[], float] = time.time,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock  # the dispatcher's wall clock (see Dispatcher)
        # The OTEL_* variables are read from here (the process's environment by default).
        self.env: Mapping[str, str] = os.environ if env is None else env
        self.tracer: AttemptTracer | None = None
        self.database_url = database_url
        self.redis_url = redis_url
        self.dispatcher: Dispatcher | None = None
        self._web: web.AppRunner | None = None
        self.metrics_port: int | None = None
        self._api: Any = None  # api.ApiServer, when WEBHOOK_API_PORT is set
        self.api_port: int | None = None
        # Background work (see _start_background); intervals are attributes for tests.
        self.gauge_interval_s = GAUGE_REFRESH_S
        self.retention_interval_s = RETENTION_INTERVAL_S
        self.partitions_interval_s = PARTITIONS_INTERVAL_S
        # The backlog and breaker readings and retention: one worker of a supervisor runs
        # them for all (see supervisor.py); the others set this to False.
        self.run_background = True
        self._breaker_redis: Any = None
        # Set when a stop abandoned the in-flight batch (the drain bound, a second signal):
        # a COMMIT that was waiting then ended by its cancellation, not by completing.
        self.abandoned = False

    async def check(self) -> str | None:
        """/readyz's look at the database: raise :class:`SchemaError` on a missing, older or
        newer schema; return why it refuses writes (a standby, as a fresh connection finds
        it or as the claim loops last found it), or None."""
        async with await open_session(
            self.database_url, name=APPLICATION_NAME, autocommit=True, connect_timeout=10
        ) as conn:
            await check_schema(conn)
            why = await read_only_reason(conn)
        if why is None and self.dispatcher is not None:
            why = self.dispatcher.read_only
        return None if why is None else f"the database is read-only ({why})"

    async def run(self, *, install_signals: bool = True) -> None:
        """Run until SIGTERM/SIGINT/SIGQUIT (or :meth:`stop`). The first signal drains: the
        in-flight batch finishes, bounded by the request timeout plus a grace period; a second
        signal (or the bound) abandons it (its rows are rolled back and delivered later)."""
        self._register_sensitive()
        raise_open_files_limit()
        metrics.without_created_series()
        self._stop_requested = asyncio.Event()
        self._forced = asyncio.Event()
        loop = asyncio.get_running_loop()
        if install_signals:  # before anything slow, so a signal during start-up is clean
            for sig in STOP_SIGNALS:
                loop.add_signal_handler(sig, self.stop, sig)
            if (early := early_stop()) is not None:
                self.stop(early)
        gate: DeliveryGate = OpenGate()
        background: Any = None
        task: asyncio.Task[None] | None = None
        try:
            self.tracer = tracer_from_env(self.env)
            conn = await wait_for_database(
                self.database_url, self.settings.startup_wait_ms, self._stop_requested
            )
            if conn is None:
                log.info("stopped before the database answered")
                return
            async with conn:
                await check_schema(conn)  # refuse a missing, older or newer schema
                await check_session_pooling(conn, self.database_url)
                await check_dispatcher_privileges(conn)
                if self.run_background:  # one worker of a supervisor says it for all
                    await warn_if_wake_up_off(conn, self.settings.poll_interval_ms)
                    await warn_if_nowhere_to_deliver(conn, self.settings)
                    await warn_if_not_vacuumed(conn)
            # A REDIS_URL that can never serve the gate stops here (ConfigError, exit 2); a
            # Redis that is down does not. One worker of a supervisor warns for all.
            redis_gate = (
                await gate_for(self.settings, self.redis_url, warn=self.run_background)
                if self.redis_url
                else None
            )
            if redis_gate is not None:
                gate = redis_gate
            self.dispatcher = Dispatcher(
                self.settings,
                conninfo=self.database_url,
                gate=gate,
                clock=self.clock,
                tracer=self.tracer,
            )
            if redis_gate is not None:
                # A breaker's transition line names the endpoints of its URL (they share it).
                targets = self.dispatcher.targets
                redis_gate.endpoints_of = lambda url: [t.id for t in targets.all() if t.url == url]
            if self._stop_requested.is_set():
                return
            if self.settings.metrics_port:
                await self._start_http()
            if self.settings.api_port is not None:
                await self._start_api()
            background = self._start_background() if self.run_background else None
            task = asyncio.create_task(self.dispatcher.run(), name="fluxora-dispatcher")
            # "dispatching" once the dispatcher is ready (its built-in endpoints recorded).
            started = asyncio.ensure_future(self.dispatcher.ready.wait())
            try:
                await asyncio.wait({task, started}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                started.cancel()
            if task.done():
                task.result()  # the dispatcher failed at its start: raise its error
            log.info(
                "dispatching (batch %d, %d claim loops, poll %d ms%s)",
                self.settings.batch_size,
                self.settings.claim_loops,
                self.settings.poll_interval_ms,
                self._egress_and_keys(),
            )
            stop = asyncio.create_task(self._stop_requested.wait())
            try:
                await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                pass  # cancelled from outside: drain as for a signal
            finally:
                stop.cancel()
            if task.done():
                task.result()  # the dispatcher ended by itself: raise its error
        finally:
            api_stopped = asyncio.create_task(self._stop_api())
            if task is not None and not task.done():
                await self._drain(task)
            await api_stopped
            if background is not None:
                await self._stop_background(background)
            await gate.close()
            if self._web is not None:
                await self._web.cleanup()
            if self.tracer is not None:
                await self._flush_spans(self.tracer)
            if install_signals:
                for sig in STOP_SIGNALS:
                    loop.remove_signal_handler(sig)
        log.info("stopped")

    async def _drain(self, task: asyncio.Task[None]) -> None:
        assert self.dispatcher is not None
        self.dispatcher.stop()
        bound = self.settings.timeout_ms / 1000 + DRAIN_GRACE_S
        forced = asyncio.create_task(self._forced.wait())
        try:
            await asyncio.wait({task, forced}, timeout=bound, return_when=asyncio.FIRST_COMPLETED)
        finally:
            forced.cancel()
        if not task.done():
            why = "a second signal" if self._forced.is_set() else f"the {bound:.1f}s drain bound"
            log.error("%s: abandoning the in-flight batch (it will be delivered later)", why)
            self.abandoned = True  # before the cancellation ends a commit's wait
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _flush_spans(self, tracer: AttemptTracer) -> None:
        """The last spans go out, in a thread of their own (the exporters block), waited
        for at most FLUSH_TIMEOUT_MS, and not at all after a second signal: an export in
        progress to a collector that does not answer ends only at the exporter's own
        timeout (10 s by default), and a daemon thread does not hold the exit."""
        loop = asyncio.get_running_loop()
        finished = asyncio.Event()
        failed: list[BaseException] = []

        def flush() -> None:
            try:
                tracer.shutdown()
            except BaseException as exc:  # reported below, never raised in the thread
                failed.append(exc)
            finally:
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                    loop.call_soon_threadsafe(finished.set)

        threading.Thread(target=flush, name="fluxora-span-flush", daemon=True).start()
        waits = {asyncio.ensure_future(finished.wait()), asyncio.ensure_future(self._forced.wait())}
        try:
            await asyncio.wait(
                waits, timeout=FLUSH_TIMEOUT_MS / 1000, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for waiting in waits:
                waiting.cancel()
        if not finished.is_set():
            why = "a second signal" if self._forced.is_set() else f"{FLUSH_TIMEOUT_MS} ms"
            log.warning("spans not flushed after %s (is the collector reachable?)", why)
        elif failed:
            log.warning("spans not flushed (%s)", type(failed[0]).__name__)
        self.tracer = None

    def _egress_and_keys(self) -> str:
        """What the start-up line says of the egress proxy and of the key secrets are
        sealed with (never a credential: the proxy's address, the key's id)."""
        said = ""
        proxy = self.settings.proxy
        if proxy is not None:
            said += f", https through the proxy {proxy.shown}"
        key = self.settings.encryption_keys.current
        if key is not None:
            said += f", secrets sealed with key {key.id}"
        return said

    def stop(self, sig: signal.Signals | None = None) -> None:
        """First call: drain and stop. A second call: stop at once. ``sig``: the signal
        that asked, named in the log line (an operator reads who stopped the process)."""
        if not hasattr(self, "_stop_requested"):
            return
        if self._stop_requested.is_set():
            self._forced.set()
            return
        log.info("stopping%s: finishing the in-flight batch", stopped_by(sig))
        self._stop_requested.set()
        if self.dispatcher is not None:
            self.dispatcher.stop()

    # -- HTTP endpoint ---------------------------------------------------------------

    async def _start_http(self) -> None:
        self._web, self.metrics_port = await serve_health(
            self.settings, metrics=self._metrics, healthz=self._healthz, readyz=self._readyz
        )

    async def _start_api(self) -> None:
        self._api = await start_api(self.settings, self.database_url, self.redis_url)
        self.api_port = self._api.port

    async def _stop_api(self) -> None:
        if self._api is not None:
            await self._api.stop(forced=self._forced)
            self._api = None

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(metrics.REGISTRY)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _readyz(self, request: web.Request) -> web.Response:
        try:
            async with asyncio.timeout(3):
                read_only = await self.check()
        except SchemaError as exc:
            return web.json_response({"status": "not ready", "reason": str(exc)}, status=503)
        except (psycopg.Error, OSError, TimeoutError) as exc:
            return web.json_response(
                {"status": "not ready", "reason": unreachable_reason(exc)}, status=503
            )
        if read_only is not None:
            return web.json_response({"status": "not ready", "reason": read_only}, status=503)
        if self.dispatcher is None or self.dispatcher.stopping:
            return web.json_response({"status": "not ready", "reason": "stopping"}, status=503)
        if not self.dispatcher.ready.is_set():
            # Its built-in endpoints not recorded yet: not dispatching ("dispatching" is
            # logged when it is), as a worker tells its supervisor only then.
            return web.json_response({"status": "not ready", "reason": "starting"}, status=503)
        stuck = commits_stuck(self.dispatcher.commit_wait_s())
        if stuck is not None:
            return web.json_response({"status": "not ready", "reason": stuck}, status=503)
        return web.json_response({"status": "ready"})

    # -- background work: gauges and retention ----------------------------------------

    def _register_sensitive(self) -> None:
        """Tell the log scrubber what must never be written."""
        logs.add_sensitive(self.settings.secret, self.settings.secret_previous)
        logs.add_sensitive(*self.settings.encryption_keys.texts)
        logs.add_sensitive_url(self.settings.webhook_url)
        register_engine_secrets(self.database_url, self.redis_url)

    def _start_background(self) -> list[asyncio.Task[None]]:
        tasks = [
            asyncio.create_task(self._refresh_gauges(), name="fluxora-gauges"),
            asyncio.create_task(self._partitions_loop(), name="fluxora-partitions"),
        ]
        if self.settings.retention_ms is not None:
            tasks.append(asyncio.create_task(self._retention_loop(), name="fluxora-retention"))
        return tasks

    async def _stop_background(self, tasks: list[asyncio.Task[None]]) -> None:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._breaker_redis is not None:
            with contextlib.suppress(Exception):
                await self._breaker_redis.aclose()
            self._breaker_redis = None

    async def _refresh_gauges(self) -> None:
        """Every ``gauge_interval_s``: the backlog gauges from one connection kept open
        (reconnected after an error), and the breaker state from Redis."""
        conn: psycopg.AsyncConnection[Any] | None = None
        try:
            while True:
                try:
                    if conn is None or conn.closed or conn.broken:
                        conn = await open_session(
                            self.database_url,
                            name=APPLICATION_NAME,
                            autocommit=True,
                            connect_timeout=5,
                        )
                    async with asyncio.timeout(max(self.gauge_interval_s, 5.0)):
                        set_backlog_gauges(await read_backlog(conn, BACKLOG_COUNT_CAP))
                except Exception as exc:  # the gauges keep their values; the loop goes on
                    metrics.BACKLOG_REFRESH_ERRORS.inc()
                    if isinstance(exc, psycopg.Error | OSError | TimeoutError):
                        log.debug("backlog gauges not refreshed: %s", type(exc).__name__)
                    else:
                        log.exception("backlog gauges not refreshed")
                    if conn is not None:
                        await conn.close()
                    conn = None
                if conn is not None and not metrics.IN_WORKER:  # else the supervisor reads it
                    await _refresh_endpoint_gauges(conn)
                await self._refresh_breaker_state()
                await asyncio.sleep(self.gauge_interval_s)
        finally:
            if conn is not None:
                await conn.close()

    async def _refresh_breaker_state(self) -> None:
        """The WEBHOOK_URL consumer's breaker, for its gauge; none without that consumer
        (a reading of a consumer that does not exist would say "closed" for ever)."""
        on = self.settings.circuit_breaker_threshold > 0 and self.settings.webhook_url
        if not (on and self.redis_url):
            return
        from .redis_connect import client_for
        from .redis_gate import read_breaker_state

        if self._breaker_redis is None:
            self._breaker_redis = client_for(
                self.redis_url, socket_connect_timeout=0.25, socket_timeout=0.5
            )
        try:
            async with asyncio.timeout(1.0):
                state = await read_breaker_state(
                    self._breaker_redis, self.settings.webhook_url, self.settings.redis_prefix
                )
        except Exception as exc:  # Redis down: the state is unknown, deliveries go on
            log.debug("breaker state not read: %s", type(exc).__name__)
            metrics.set_breaker_state(None)
            return
        metrics.set_breaker_state(state.state)

    async def _retention_loop(self) -> None:
        """With ``WEBHOOK_RETENTION``: prune at start-up, then every retention interval.

        Instances take turns through an advisory lock (a run that finds it taken is
        skipped); batches are small and paced, so dispatching is not disturbed.
        """
        assert self.settings.retention_ms is not None
        while True:
            try:
                async with await open_session(
                    self.database_url, name=APPLICATION_NAME, autocommit=True, connect_timeout=10
                ) as conn:
                    result = await self._retention_run(conn)
            except (psycopg.Error, OSError) as exc:
                metrics.RETENTION_RUNS.labels(result="error").inc()
                log.warning(
                    "retention run failed (%s); next run in %.0fs",
                    type(exc).__name__,
                    self.retention_interval_s,
                )
            except Exception:  # never let the task die: the next run may succeed
                metrics.RETENTION_RUNS.labels(result="error").inc()
                log.exception("retention run failed")
            else:
                metrics.RETENTION_RUNS.labels(result="skipped" if result.skipped else "ok").inc()
                if result.outbox_rows or result.dead_letters:
                    log.info(
                        "retention: deleted %d processed outbox row(s) and %d dead letter(s)"
                        " older than %s",
                        result.outbox_rows,
                        result.dead_letters,
                        result.cutoff.isoformat() if result.cutoff else "?",
                    )
            await asyncio.sleep(self.retention_interval_s)

    async def _retention_run(self, conn: psycopg.AsyncConnection[Any]) -> PruneResult:
        """One retention run, under the one retention lock (instances take turns for the
        whole run, and none deletes rows of a partition another is detaching). A
        partitioned outbox drops whole partitions first; rows are deleted only from what
        is left below the partition that holds the cutoff (the old table's rows from before
        the conversion, expired partitions an unprocessed row still holds) and from the
        default partition. The partitions from the cutoff's on are dropped whole when they
        expire."""
        from . import partitions, retention

        assert self.settings.retention_ms is not None
        async with retention.exclusive_run(conn) as held:
            if not held:
                return retention.PruneResult(cutoff=None, skipped=True)
            await self._drop_partitions(conn)
            return await retention.prune(
                conn,
                older_than_ms=self.settings.retention_ms,
                dead_letters=True,
                batch_size=RETENTION_BATCH_SIZE,
                pause_s=RETENTION_PAUSE_S,
                on_batch=_count_pruned,
                spare=await partitions.whole_partitions(
                    conn, older_than_ms=self.settings.retention_ms
                ),
            )

    async def _drop_partitions(self, conn: psycopg.AsyncConnection[Any]) -> None:
        from . import partitions

        assert self.settings.retention_ms is not None
        try:
            # Waited for (the partitions loop or another instance holds it for moments):
            # skipped, the expired partitions' rows would be deleted one by one below.
            done = await partitions.drop_expired_exclusive(
                conn,
                older_than_ms=self.settings.retention_ms,
                wait=True,
                on_wait=lambda: log.info(
                    "retention: waiting for another process to finish with the outbox's"
                    " partitions (a dispatcher making or dropping them, or `prune`)"
                ),
            )
        except partitions.PartitionsNotDropped as exc:  # their rows are pruned one by one
            log.warning("retention: %s", exc)
            return
        for one in done[0] if done else ():
            metrics.RETENTION_DELETED.labels(table="outbox").inc(one.rows)

    async def _partitions_loop(self) -> None:
        """A partitioned outbox has its partitions ready ahead: at start-up, then every
        ``partitions_interval_s`` (one instance at a time)."""
        from . import partitions

        while True:
            try:
                async with await open_session(
                    self.database_url, name=APPLICATION_NAME, autocommit=True, connect_timeout=10
                ) as conn:
                    if (await partitions.layout(conn)).partitioned:
                        async with session_lock(conn, partitions.PARTITION_LOCK_KEY) as held:
                            if held:
                                await partitions.ensure_ahead(conn)
            except Exception as exc:  # the partitions ahead last intervals: try again later
                log.warning(
                    "outbox partitions not checked (%s)",
                    partitions.describe_maintenance_failure(exc),
                )
            await asyncio.sleep(self.partitions_interval_s)


async def _refresh_endpoint_gauges(conn: psycopg.AsyncConnection[Any]) -> None:
    """The per-endpoint series from one reading, bounded on the server (the backlog gauges
    do not depend on it: a failed reading keeps the last one)."""
    try:
        health = await read_endpoint_health(
            conn, METRIC_ENDPOINTS, timeout_ms=ENDPOINT_READING_TIMEOUT_MS
        )
    except (psycopg.Error, OSError) as exc:
        log.debug("endpoint health not read: %s", type(exc).__name__)
        return
    except Exception:  # never let the gauges' task die
        log.exception("endpoint health not read")
        return
    set_endpoint_gauges(health)


async def start_api(settings: Settings, database_url: str, redis_url: str | None) -> Any:
    """Serve the management API and dashboard in this loop (``WEBHOOK_API_PORT``); returns
    the started ``api.ApiServer``, which the caller stops."""
    try:  # the api extra, imported only when it is served
        from .api import ApiConfig, ApiServer
    except ImportError as exc:
        raise ConfigError(
            "WEBHOOK_API_PORT", f"serving the API needs fluxora-webhooks[api] ({exc.name})"
        ) from None
    assert settings.api_port is not None
    config = ApiConfig.from_settings(settings, database_url=database_url, redis_url=redis_url)
    server = ApiServer(config, settings.api_host, settings.api_port)
    await server.start()
    return server


def _count_pruned(table: str, rows: int) -> None:
    metrics.RETENTION_DELETED.labels(table=table).inc(rows)
