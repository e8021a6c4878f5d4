"""What the machine gives a process: the CPUs it may run on, its open-files limit, and the
signals that stop it."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger(__name__)

# WEBHOOK_WORKERS defaults to the usable CPUs, at most this many (SPEC section 16): past
# that, one machine's dispatchers mostly compete for the database's connections and locks.
MAX_DEFAULT_WORKERS = 16
# Asked for when the hard limit is "unlimited", which no kernel grants as a soft limit.
_UNLIMITED_NOFILE = 1 << 20
# What stops `run` and `api`: the first drains, a second stops at once. SIGQUIT is one
# of them rather than Python's default (a core dump, the batch's rows left to their
# lease): some platforms and images stop a container with it, and Ctrl-\ sends it.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)


_early: list[signal.Signals] = []  # a stop signal that came before the event loop's handlers


def hold_early_stops() -> None:
    """Keep a stop signal that arrives before the command's event loop takes the stop
    signals over (``add_signal_handler``), instead of Python's default for it: a SIGTERM
    in the first second of start-up (imports, configuration) ended the process at once,
    exit 143 and no line, where `run` and `api` promise exit 0. The loop's handler then
    stops the command as if the signal came then (:func:`early_stop`)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _keep_early)


def _keep_early(signum: int, frame: object) -> None:
    if not _early:
        _early.append(signal.Signals(signum))
        return
    # A second one (Ctrl-C again): Python's default, at once.
    signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def early_stop() -> signal.Signals | None:
    """The stop signal :func:`hold_early_stops` kept, if any (once: it is forgotten)."""
    return _early.pop() if _early else None


def stopped_by(sig: signal.Signals | None) -> str:
    """The words " on SIGTERM" for a stop's log line ("stopping on SIGTERM: ..."); "" for a stop
    asked in code."""
    return f" on {sig.name}" if sig is not None else ""


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask: what a container or taskset
    allows), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity masks (macOS)
        return os.cpu_count() or 1


def default_workers() -> int:
    return max(1, min(usable_cpus(), MAX_DEFAULT_WORKERS))


def raise_open_files_limit() -> int | None:
    """Raise the soft RLIMIT_NOFILE to the hard limit (SPEC section 11: many endpoints, each
    with its connections, must not run out of descriptors). Returns the soft limit now in
    force, or None where there are no such limits."""
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = _UNLIMITED_NOFILE if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError) as exc:  # a platform cap below the hard limit
            log.warning("open files limit stays at %d (%s)", soft, type(exc).__name__)
            return soft
        log.debug("open files limit raised from %d to %d", soft, wanted)
        return wanted
    return soft


def run_async(main: Coroutine[Any, Any, int]) -> int:
    """Run a command's coroutine to completion, on uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
        return asyncio.run(main)
    return int(uvloop.run(main))
