"""``fluxora-webhooks run`` with ``WEBHOOK_WORKERS`` above 1: one supervisor, N dispatchers.

The supervisor dispatches nothing itself. At start-up it checks the schema and that the
workers' database connections fit in what the server has free, then starts the workers
(:mod:`.worker`: fresh interpreters, each in a session of its own, so a terminal's Ctrl-C
reaches the supervisor only and each worker sees one signal), and serves the one
``/metrics``, ``/healthz`` and ``/readyz`` for all of them:

- ``/metrics`` merges the workers' files (prometheus-client's multiprocess mode, in a
  fresh folder per run) and adds the supervisor's own series: workers dispatching and
  worker restarts;
- ``/readyz`` is ready while the database answers with the expected schema, accepts
  writes, and every worker dispatches.

A worker that dies is replaced after a back-off (1 s, doubling up to 30 s, back to 1 s once
a worker has lived a minute), logged and counted. A ready worker says it is alive every
second on its pipe; one not heard for SILENT_S (stopped, wedged) is not counted as
dispatching until it is heard again, and one not heard for UNRESPONSIVE_S is killed and
replaced as a dead one is (never while the supervisor stops: the drain has its own bound).
SIGTERM/SIGINT/SIGQUIT send SIGTERM to every worker, which drains as a single-process
``run`` does; the supervisor waits for them (bounded by the request timeout plus the drain
grace, and a margin), kills any left and exits 0. A second signal is forwarded as well: the
workers then stop at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    generate_latest,
    multiprocess,
)

from . import logs, metrics
from .dispatcher import APPLICATION_NAME
from .errors import EXIT_CONFIG, EXIT_SCHEMA, ConfigError, SchemaError
from .host import STOP_SIGNALS, early_stop, stopped_by
from .migrations import (
    check_dispatcher_privileges,
    check_schema,
    check_session_pooling,
    read_only_reason,
    unreachable_reason,
)
from .ops import METRIC_ENDPOINTS, read_endpoint_health, set_endpoint_gauges
from .pgtypes import open_session
from .queries import query
from .service import (
    DRAIN_GRACE_S,
    ENDPOINT_READING_TIMEOUT_MS,
    GAUGE_REFRESH_S,
    serve_health,
    start_api,
    wait_for_database,
)
from .settings import Settings, register_engine_secrets
from .telemetry import check_env as check_telemetry_env

log = logging.getLogger("fluxora_webhooks.supervisor")

RESTART_MIN_S = 1.0
RESTART_MAX_S = 30.0
HEALTHY_AFTER_S = 60.0
# Beyond the workers' own drain bound, before the supervisor kills a worker that hangs.
KILL_MARGIN_S = 5.0
# A ready worker writes a line on its pipe every second (worker.COMMIT_CHECK_S). Not heard
# for SILENT_S: not counted as dispatching (/readyz 503 naming it), until it is heard
# again. Not heard for UNRESPONSIVE_S: killed (SIGKILL) and replaced, like gunicorn's
# worker timeout. FLUXORA_WORKER_SILENT_S and FLUXORA_WORKER_UNRESPONSIVE_S in run's
# environment change them, for tests only.
SILENT_S = 10.0
UNRESPONSIVE_S = 60.0
# How often the supervisor looks at when it last heard each worker.
SILENCE_CHECK_S = 1.0
# A worker's connections beyond its claim loops: the pool's spare and the LISTEN one.
WORKER_EXTRA_CONNECTIONS = 2
# Worker 0's backlog reading and retention, the supervisor's readiness check and its
# reading of the endpoints' health (at a scrape, at most every GAUGE_REFRESH_S).
SHARED_CONNECTIONS = 4


def connections_needed(workers: int, claim_loops: int) -> int:
    """The database connections of ``workers`` workers at most."""
    return workers * (claim_loops + WORKER_EXTRA_CONNECTIONS) + SHARED_CONNECTIONS


@dataclass(frozen=True)
class ConnectionBudget:
    """What the server allows now (``connection_budget`` in ``sql/queries.sql``)."""

    max_connections: int
    reserved: int  # superuser_reserved_connections (+ reserved_connections, PostgreSQL 16+)
    in_use: int
    # The role's and the database's own CONNECTION LIMIT (-1: none) and their use now.
    role_limit: int = -1
    role_in_use: int = 0
    database_limit: int = -1
    database_in_use: int = 0

    @property
    def free(self) -> int:
        return self.max_connections - self.reserved - self.in_use

    def shortest(self) -> tuple[int, str, str]:
        """The fewest connections any limit leaves: (free, what it is, what to raise)."""
        found = [
            (
                self.free,
                f"the server has {self.free} free (max_connections {self.max_connections}"
                f" - {self.reserved} reserved - {self.in_use} in use)",
                "raise max_connections on the server",
            )
        ]
        for whose, limit, in_use, statement in (
            ("role", self.role_limit, self.role_in_use, "ROLE"),
            ("database", self.database_limit, self.database_in_use, "DATABASE"),
        ):
            if limit >= 0:
                free = limit - in_use
                found.append(
                    (
                        free,
                        f"the {whose}'s CONNECTION LIMIT leaves {free} (limit {limit}"
                        f" - {in_use} in use)",
                        f"raise it (ALTER {statement} ... CONNECTION LIMIT)",
                    )
                )
        return min(found, key=lambda one: one[0])


def check_budget(settings: Settings, budget: ConnectionBudget) -> None:
    """Refuse (naming what to change) when the workers would not fit."""
    need = connections_needed(settings.workers, settings.claim_loops)
    free, why, fix = budget.shortest()
    if need <= free:
        return
    raise ConfigError(
        "WEBHOOK_WORKERS",
        f"{settings.workers} workers x ({settings.claim_loops} claim loops "
        f"+ {WORKER_EXTRA_CONNECTIONS}) + {SHARED_CONNECTIONS} = {need} database connections, "
        f"but {why}: lower WEBHOOK_WORKERS or WEBHOOK_CLAIM_LOOPS, or {fix}",
    )


async def read_budget(conn: psycopg.AsyncConnection[Any]) -> ConnectionBudget:
    row = await (await conn.execute(query("connection_budget"))).fetchone()
    assert row is not None
    # This connection closes before the workers start: it is not theirs to count.
    return ConnectionBudget(
        int(row[0]),
        int(row[1]),
        max(0, int(row[2]) - 1),
        role_limit=-1 if row[3] is None else int(row[3]),
        role_in_use=max(0, int(row[4]) - 1),
        database_limit=-1 if row[5] is None else int(row[5]),
        database_in_use=max(0, int(row[6]) - 1),
    )


@dataclass
class _Worker:
    index: int
    proc: asyncio.subprocess.Process
    started: float = field(default_factory=time.monotonic)
    ready: bool = False
    stuck: str | None = None  # why its commits do not complete, as it last said
    heard: float = field(default_factory=time.monotonic)  # its last line on the pipe
    silent: bool = False  # not heard for SILENT_S (not counted as dispatching meanwhile)
    unresponsive: bool = False  # killed for not being heard for UNRESPONSIVE_S

    @property
    def dispatching(self) -> bool:
        return self.ready and not self.silent


class Supervisor:
    """Runs ``settings.workers`` worker processes until SIGTERM/SIGINT/SIGQUIT (or
    :meth:`stop`)."""

    def __init__(
        self,
        settings: Settings,
        *,
        database_url: str,
        redis_url: str | None,
        env: dict[str, str],
    ) -> None:
        self.settings = settings
        self.database_url = database_url
        self.redis_url = redis_url
        self.env = env
        self.metrics_port: int | None = None
        self.workers: dict[int, _Worker] = {}
        self.metrics_dir = ""
        self._web: web.AppRunner | None = None
        self._api: Any = None  # the management API (api.ApiServer): here, not in the workers
        self.api_port: int | None = None
        self._stopping = asyncio.Event()
        self._forced = asyncio.Event()  # a second signal: the API's requests are cut off
        self._signals = 0
        # Non-zero: a worker stopped on its configuration or the schema at start-up, and
        # `run` exits with its status.
        self.exit_code = 0
        self._ever_ready = False  # whether any worker has reported ready
        self._readers: set[asyncio.Task[None]] = set()
        # What /metrics shows: the workers' files, and the supervisor's own series (no
        # worker has a sample of them: see metrics.py), the API's when it serves it.
        self._registry = CollectorRegistry()
        for own in (metrics.WORKERS, metrics.WORKER_RESTARTS):
            self._registry.register(own)
        if self.settings.api_port is not None:
            self._registry.register(metrics.API_REQUESTS)
            self._registry.register(metrics.API_REQUEST_DURATION)
        # The per-endpoint series are read here, not by a worker (see metrics.py).
        self._registry.register(metrics.ENDPOINTS_COLLECTOR)
        self._endpoints_read_at = -GAUGE_REFRESH_S
        self._endpoints_lock = asyncio.Lock()
        self.silent_s = _seconds(env, "FLUXORA_WORKER_SILENT_S", SILENT_S)
        self.unresponsive_s = _seconds(env, "FLUXORA_WORKER_UNRESPONSIVE_S", UNRESPONSIVE_S)

    async def run(self, *, install_signals: bool = True) -> None:
        loop = asyncio.get_running_loop()
        if install_signals:
            for sig in STOP_SIGNALS:
                loop.add_signal_handler(sig, self.stop, sig)
            if (early := early_stop()) is not None:
                self.stop(early)
        logs.add_sensitive(self.settings.secret, self.settings.secret_previous)
        logs.add_sensitive_url(self.settings.webhook_url)
        register_engine_secrets(self.database_url, self.redis_url)
        metrics.without_created_series()
        slots: list[asyncio.Task[None]] = []
        watchdog: asyncio.Task[None] | None = None
        try:
            check_telemetry_env(self.env)
            conn = await wait_for_database(
                self.database_url, self.settings.startup_wait_ms, self._stopping
            )
            if conn is None:
                return
            async with conn:
                await self._check_database(conn)
            if self._stopping.is_set():
                return
            self.metrics_dir = _make_metrics_dir(self.settings.workers)
            _merge_worker_files(self._registry, self.metrics_dir)
            metrics.WORKERS.labels(state="wanted").set(self.settings.workers)
            metrics.WORKERS.labels(state="dispatching").set(0)
            if self.settings.metrics_port:
                await self._start_http()
            if self.settings.api_port is not None:
                await self._start_api()
            log.info(
                "supervising %d workers (batch %d, %d claim loops each)",
                self.settings.workers,
                self.settings.batch_size,
                self.settings.claim_loops,
            )
            slots = [
                asyncio.create_task(self._keep_running(i), name=f"fluxora-worker-{i}")
                for i in range(self.settings.workers)
            ]
            watchdog = asyncio.create_task(self._watch_silence(), name="fluxora-silence")
            await self._stopping.wait()
        finally:
            if watchdog is not None:
                watchdog.cancel()
                await asyncio.gather(watchdog, return_exceptions=True)
            api_stopped = asyncio.create_task(self._stop_api())
            await self._drain(slots)
            await api_stopped
            if self._web is not None:
                await self._web.cleanup()
            if self.metrics_dir:
                shutil.rmtree(self.metrics_dir, ignore_errors=True)
            if install_signals:
                for sig in STOP_SIGNALS:
                    loop.remove_signal_handler(sig)
        log.info("stopped")

    async def _start_api(self) -> None:
        self._api = await start_api(self.settings, self.database_url, self.redis_url)
        self.api_port = self._api.port

    async def _stop_api(self) -> None:
        if self._api is not None:
            await self._api.stop(forced=self._forced)
            self._api = None

    def stop(self, sig: signal.Signals | None = None) -> None:
        """First call: the workers drain. Later calls: they stop at once. ``sig``: the
        signal that asked, named in the log line."""
        self._signals += 1
        if self._signals == 1:
            log.info("stopping%s: the workers finish their in-flight batches", stopped_by(sig))
            self._stopping.set()
        else:
            self._forced.set()
        self._signal_workers(signal.SIGTERM)

    async def _check_database(self, conn: psycopg.AsyncConnection[Any]) -> None:
        await check_schema(conn)
        await check_session_pooling(conn, self.database_url)
        await check_dispatcher_privileges(conn)
        check_budget(self.settings, await read_budget(conn))

    # -- workers ---------------------------------------------------------------------

    async def _keep_running(self, index: int) -> None:
        """One worker slot: start it, and start it again after it died."""
        backoff = RESTART_MIN_S
        while not self._stopping.is_set():
            try:
                worker = await self._spawn(index)
            except OSError as exc:  # out of processes or descriptors: try again later
                log.error(
                    "worker %d could not be started (%s); trying again in %.0fs",
                    index,
                    exc.strerror or type(exc).__name__,
                    backoff,
                )
            else:
                if self._stopping.is_set():  # stopped while it was being started
                    with contextlib.suppress(ProcessLookupError):
                        worker.proc.send_signal(signal.SIGTERM)
                code = await worker.proc.wait()
                self._forget(worker)
                if self._stopping.is_set():
                    return
                if code in (EXIT_CONFIG, EXIT_SCHEMA) and not self._ever_ready:
                    # Before any worker was ready, a worker refused its configuration (or
                    # the schema), as every worker would, each time: stop, with its exit
                    # status, rather than start it again forever. Its message is on
                    # stderr, above. Once workers have run, a worker that exits so (a
                    # newer schema migrated meanwhile) is started again, as any other.
                    log.error(
                        "worker %d (pid %d) stopped at start-up with a %s error; stopping",
                        index,
                        worker.proc.pid,
                        "configuration" if code == EXIT_CONFIG else "schema",
                    )
                    if self.exit_code == 0:
                        self.exit_code = code
                        self.stop()
                    return
                if time.monotonic() - worker.started >= HEALTHY_AFTER_S:
                    backoff = RESTART_MIN_S
                cause = "unresponsive" if worker.unresponsive else "signal" if code < 0 else "exit"
                metrics.WORKER_RESTARTS.labels(cause=cause).inc()
                log.error(
                    "worker %d (pid %d) %s%s; starting another in %.0fs",
                    index,
                    worker.proc.pid,
                    _describe_exit(code),
                    " (it had not answered)" if worker.unresponsive else "",
                    backoff,
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), backoff)
            backoff = min(backoff * 2, RESTART_MAX_S)

    async def _spawn(self, index: int) -> _Worker:
        read_fd, write_fd = os.pipe()
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "fluxora_webhooks.worker",
                "--index", str(index), "--ready-fd", str(write_fd),
                "--supervisor", str(os.getpid()),
                env=self._worker_env(), stdin=asyncio.subprocess.DEVNULL,
                pass_fds=(write_fd,), start_new_session=True,
            )  # fmt: skip
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        worker = _Worker(index, proc)
        self.workers[index] = worker
        log.info("worker %d started (pid %d)", index, proc.pid)
        reader = asyncio.create_task(
            self._await_ready(worker, read_fd), name=f"fluxora-ready-{index}"
        )
        self._readers.add(reader)
        reader.add_done_callback(self._readers.discard)
        return worker

    def _worker_env(self) -> dict[str, str]:
        env = dict(self.env)
        env.pop("REDIS_URL", None)
        env.update(
            DATABASE_URL=self.database_url,
            WEBHOOK_WORKERS="1",
            PROMETHEUS_MULTIPROC_DIR=self.metrics_dir,
            # What makes it a worker for metrics.py (PROMETHEUS_MULTIPROC_DIR alone may be
            # inherited from an environment made for something else).
            **{metrics.WORKER_VARIABLE: "1"},
        )
        if self.redis_url:
            env["REDIS_URL"] = self.redis_url
        return env

    async def _await_ready(self, worker: _Worker, read_fd: int) -> None:
        """The worker writes one line when it dispatches, then whether its commits complete
        as that changes (``stuck <reason>``, ``flowing``), and ``alive`` every second when
        it has nothing else to say; end of file when it exits. Each line is when it was last
        heard (see :meth:`_watch_silence`)."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        pipe = os.fdopen(read_fd, "rb", buffering=0)
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), pipe
        )
        try:
            if (await reader.readline()).strip() != b"ready":
                return
            self._ever_ready = True  # it dispatched, even if it has exited since
            worker.heard = time.monotonic()
            if worker.proc.returncode is None:
                worker.ready = True
                self._count_ready()
            while line := (await reader.readline()).decode(errors="replace").strip():
                self._heard(worker)
                if line == "alive":
                    continue
                was_stuck = worker.stuck is not None
                worker.stuck = line[len("stuck ") :] if line.startswith("stuck ") else None
                # Said once each way: the reason's wait grows every second while it lasts
                # (/readyz shows it as it is).
                if worker.stuck is not None and not was_stuck:
                    log.error("worker %d: %s", worker.index, worker.stuck)
                elif worker.stuck is None and was_stuck:
                    log.info("worker %d: its commits complete again", worker.index)
        finally:
            transport.close()

    def _heard(self, worker: _Worker) -> None:
        now = time.monotonic()
        if worker.silent:
            worker.silent = False
            log.info(
                "worker %d (pid %d) answers again, after %.0f s",
                worker.index,
                worker.proc.pid,
                now - worker.heard,
            )
            self._count_ready()
        worker.heard = now

    async def _watch_silence(self) -> None:
        """Each ready worker's last line: not heard for ``silent_s``, it is not counted as
        dispatching (logged once, until it is heard again); for ``unresponsive_s``, it is
        killed and its slot starts another (:meth:`_keep_running`). Not while stopping: a
        worker that hangs then is the drain's to kill."""
        while not self._stopping.is_set():
            await asyncio.sleep(min(SILENCE_CHECK_S, self.silent_s / 4))
            now = time.monotonic()
            for worker in list(self.workers.values()):
                if self._stopping.is_set():
                    return
                if not worker.ready or worker.proc.returncode is not None:
                    continue
                quiet = now - worker.heard
                if quiet > self.silent_s and not worker.silent:
                    worker.silent = True
                    log.error(
                        "worker %d (pid %d) has not answered for %.0f s; not counted as"
                        " dispatching until it does (killed after %.0f s)",
                        worker.index,
                        worker.proc.pid,
                        quiet,
                        self.unresponsive_s,
                    )
                    self._count_ready()
                if quiet > self.unresponsive_s and not worker.unresponsive:
                    worker.unresponsive = True
                    log.error(
                        "worker %d (pid %d) has not answered for %.0f s: killing it",
                        worker.index,
                        worker.proc.pid,
                        quiet,
                    )
                    with contextlib.suppress(ProcessLookupError):
                        worker.proc.send_signal(signal.SIGKILL)

    def _forget(self, worker: _Worker) -> None:
        if self.workers.get(worker.index) is worker:
            del self.workers[worker.index]
        # Its in-flight gauge must not be summed any more (multiprocess_mode="livesum").
        _mark_dead(worker.proc.pid, self.metrics_dir)
        self._count_ready()

    def _count_ready(self) -> None:
        ready = sum(1 for w in self.workers.values() if w.dispatching)
        metrics.WORKERS.labels(state="dispatching").set(ready)

    def _signal_workers(self, sig: signal.Signals) -> None:
        for worker in list(self.workers.values()):
            if worker.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.proc.send_signal(sig)

    async def _drain(self, slots: list[asyncio.Task[None]]) -> None:
        """Wait for every worker to drain (the signal was sent by stop); kill the ones that
        outlive the bound. Their in-flight batches roll back and are delivered later."""
        if not self._stopping.is_set():  # an error or a cancellation, not a signal
            self._stopping.set()
            self._signal_workers(signal.SIGTERM)
        if not slots:
            return
        bound = self.settings.timeout_ms / 1000 + DRAIN_GRACE_S + KILL_MARGIN_S
        _, late = await asyncio.wait(slots, timeout=bound)
        if late:
            log.error("%d worker(s) still running after %.0fs: killing them", len(late), bound)
            self._signal_workers(signal.SIGKILL)
            await asyncio.wait(late, timeout=10)
        for task in slots:
            if task.done() and not task.cancelled() and task.exception() is not None:
                log.error("worker slot failed", exc_info=task.exception())

    # -- HTTP endpoint ---------------------------------------------------------------

    async def _start_http(self) -> None:
        self._web, self.metrics_port = await serve_health(
            self.settings, metrics=self._metrics, healthz=self._healthz, readyz=self._readyz
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        await self._read_endpoints()
        body = await asyncio.to_thread(generate_latest, self._registry)  # reads N files
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _read_endpoints(self) -> None:
        """The endpoints' health for the per-endpoint series, read at a scrape when the last
        reading is older than GAUGE_REFRESH_S (bounded: a slow database keeps the last
        reading, it does not hold the scrape)."""
        async with self._endpoints_lock:
            if time.monotonic() - self._endpoints_read_at < GAUGE_REFRESH_S:
                return
            self._endpoints_read_at = time.monotonic()
            try:
                async with asyncio.timeout(ENDPOINT_READING_TIMEOUT_MS / 1000 + 2):
                    async with await open_session(
                        self.database_url, name=APPLICATION_NAME, autocommit=True, connect_timeout=3
                    ) as conn:
                        health = await read_endpoint_health(
                            conn, METRIC_ENDPOINTS, timeout_ms=ENDPOINT_READING_TIMEOUT_MS
                        )
                        set_endpoint_gauges(health)
            except Exception as exc:  # the last reading stays
                log.debug("endpoint health not read: %s", type(exc).__name__)

    def _worker_counts(self) -> dict[str, int]:
        ready = sum(1 for w in self.workers.values() if w.dispatching)
        return {"wanted": self.settings.workers, "dispatching": ready}

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "workers": self._worker_counts()})

    async def _readyz(self, request: web.Request) -> web.Response:
        try:
            async with asyncio.timeout(3):
                async with await open_session(
                    self.database_url, name=APPLICATION_NAME, autocommit=True, connect_timeout=3
                ) as conn:
                    await check_schema(conn)
                    read_only = await read_only_reason(conn)
        except SchemaError as exc:
            return _not_ready(str(exc), self._worker_counts())
        except (psycopg.Error, OSError, TimeoutError) as exc:
            return _not_ready(unreachable_reason(exc), self._worker_counts())
        counts = self._worker_counts()
        if read_only is not None:
            return _not_ready(f"the database is read-only ({read_only})", counts)
        if self._stopping.is_set():
            return _not_ready("stopping", counts)
        silent = sorted((w for w in self.workers.values() if w.silent), key=lambda w: w.index)
        if silent:
            quiet = time.monotonic() - silent[0].heard
            reason = f"worker {silent[0].index} has not answered for {quiet:.0f} s"
            return _not_ready(reason, counts)
        if counts["dispatching"] < counts["wanted"]:
            reason = f"{counts['dispatching']} of {counts['wanted']} workers dispatching"
            return _not_ready(reason, counts)
        stuck = [w for w in self.workers.values() if w.stuck is not None]
        if stuck:
            return _not_ready(f"worker {stuck[0].index}: {stuck[0].stuck}", counts)
        return web.json_response({"status": "ready", "workers": counts})


METRICS_DIR_PREFIX = "fluxora-metrics-"
# The metrics folders this process made (a test may run several supervisors in one).
_MADE_HERE: set[str] = set()


def _make_metrics_dir(workers: int) -> str:
    """The run's own folder for the workers' metric files, in the temporary folder
    (``TMPDIR``, else /tmp, ...), after removing those of supervisors that are gone. A
    container whose file system is read-only has none: said as the configuration it is."""
    try:
        parent = tempfile.gettempdir()
        _remove_orphaned_metrics_dirs(parent)
        made = tempfile.mkdtemp(prefix=f"{METRICS_DIR_PREFIX}{os.getpid()}-", dir=parent)
    except OSError as exc:
        why = exc.strerror or str(exc)
        where = f"{why}: {exc.filename}" if exc.filename else why
        raise ConfigError(
            "WEBHOOK_WORKERS",
            f"{workers} workers need a writable temporary folder for their metrics ({where});"
            " give the container one (an emptyDir or a tmpfs at /tmp, or TMPDIR naming a"
            " writable folder), or set WEBHOOK_WORKERS=1 (one process writes no file)",
        ) from None
    _MADE_HERE.add(os.path.realpath(made))
    return made


def _remove_orphaned_metrics_dirs(parent: str) -> list[str]:
    """Remove the metrics directories of supervisors that are gone (killed, so their own
    clean-up never ran): a directory is named after its supervisor's pid, and one is removed
    only when it is ours (same user) and no other process has that pid. One named after
    this process's pid that this process did not make is an earlier process's: a
    container's supervisor is pid 1 at every restart, and a /tmp that outlives the
    container's process (a pod's emptyDir) keeps what the one killed left. Returns what it
    removed."""
    removed: list[str] = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        pid_text = name[len(METRICS_DIR_PREFIX) :].split("-", 1)[0]
        if not name.startswith(METRICS_DIR_PREFIX) or not pid_text.isdigit():
            continue
        path = os.path.join(parent, name)
        try:
            pid = int(pid_text)
            if os.stat(path).st_uid != os.getuid():
                continue
            if pid == os.getpid() and os.path.realpath(path) in _MADE_HERE:
                continue
            if pid != os.getpid() and _alive(pid):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# prometheus-client's multiprocess helpers are untyped; these name their types.
def _merge_worker_files(registry: CollectorRegistry, path: str) -> None:
    collector: Callable[..., object] = multiprocess.MultiProcessCollector
    collector(registry, path=path)


def _mark_dead(pid: int, path: str) -> None:
    mark: Callable[[int, str], None] = multiprocess.mark_process_dead
    mark(pid, path)


def _seconds(env: dict[str, str], name: str, default: float) -> float:
    """A positive number of seconds from ``env`` (the bounds' variables, for tests)."""
    try:
        value = float(env.get(name, "").strip() or default)
    except ValueError:
        return default
    return value if value > 0 else default


def _not_ready(reason: str, workers: dict[str, int]) -> web.Response:
    body = {"status": "not ready", "reason": reason, "workers": workers}
    return web.json_response(body, status=503)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"
