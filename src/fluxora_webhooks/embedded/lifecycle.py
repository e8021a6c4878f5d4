"""Holding the embedded engines: the shared folder's locks, and the public entry points
(see the package docstring for the protocol)."""

from __future__ import annotations

import atexit
import fcntl
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

from .postgres import start_postgres, stop_postgres
from .processes import display_path, exclusive_lock, open_lock_file
from .redisserver import start_redis, stop_redis

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- public API


def embedded_database_url(home: Path) -> str:
    """Start (or reuse) the embedded PostgreSQL in ``home / "postgres"``.

    Returns a URL to the ``fluxora`` database (created if missing) for psycopg. The calling
    process keeps the server up until it exits; use :class:`EmbeddedEngines` to release it
    sooner.
    """
    return _with_process_hold(home, start_postgres)


def embedded_redis_url(home: Path) -> str:
    """Start (or reuse) the embedded Redis in ``home / "redis"``.

    Returns a ``unix://`` URL for ``redis.asyncio.from_url``. The calling process keeps the
    server up until it exits; use :class:`EmbeddedEngines` to release it sooner.
    """
    return _with_process_hold(home, start_redis)


def stop_embedded(home: Path) -> bool:
    """Stop the engines in ``home`` unless a live process (this one included) uses them.

    Returns True when no engine is left running. Useful after a crashed command, whose
    engines stay up until the next command using the folder exits.
    """
    home = home.expanduser().resolve()
    if not home.is_dir():
        return True
    with exclusive_lock(home / ".lock"):
        return _stop_if_unused(home)


def describe(home: Path, *, postgres: bool = True, redis: bool = True) -> str:
    """The one-line notice a command prints when it runs on embedded engines."""
    engines = [name for name, used in (("PostgreSQL", postgres), ("Redis", redis)) if used]
    variables = [name for name, used in (("DATABASE_URL", postgres), ("REDIS_URL", redis)) if used]
    if not engines:
        return ""
    return (
        f"Running on the embedded {' and '.join(engines)} in {display_path(home)} "
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
            self._database_url = start_postgres(self.home)
        return self._database_url

    def redis_url(self) -> str:
        """Start (or reuse) Redis; a ``unix://`` URL."""
        if self._redis_url is None:
            self._hold()
            self._redis_url = start_redis(self.home)
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
            with exclusive_lock(home / ".lock"):
                fd = open_lock_file(home / ".users")
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
        with exclusive_lock(home / ".lock"):
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
    fd = open_lock_file(home / ".users")
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.debug("embedded engines in %s still in use", home)
            return False
        stop_redis(home)
        stop_postgres(home)
        return True
    finally:
        os.close(fd)


def _prepare_home(home: Path) -> Path:
    home = home.expanduser().resolve()
    home.mkdir(parents=True, exist_ok=True)
    (home / "logs").mkdir(exist_ok=True)
    return home
