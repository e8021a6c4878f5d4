"""One dispatcher process under the supervisor: ``python -m fluxora_webhooks.worker``.

Started by :mod:`.supervisor` only, in a fresh interpreter whose environment already holds
``PROMETHEUS_MULTIPROC_DIR`` (prometheus-client picks its multiprocess mode when it is first
imported, before any metric exists), ``FLUXORA_WORKER=1`` (what tells :mod:`.metrics` it is
a worker) and the resolved ``DATABASE_URL``/``REDIS_URL``. It
runs the same :class:`~fluxora_webhooks.service.Service` as a single-process ``run``, with
no HTTP endpoint of its own; worker 0 also runs the background readings and retention for
all. It tells the supervisor through ``--ready-fd`` when it dispatches, drains on
SIGTERM/SIGINT/SIGQUIT like ``run``, and drains as well when the supervisor is gone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import sys
from collections.abc import Sequence

from . import logs
from .errors import EXIT_CONFIG, EXIT_SCHEMA, ConfigError, FluxoraError, SchemaError
from .host import run_async
from .service import Service, commits_stuck
from .settings import Settings, check_client_certificate

PARENT_CHECK_S = 1.0
# How often a worker looks whether its commits complete (for the supervisor's /readyz),
# and says it is alive when that has not changed (the supervisor's bound on a silent
# worker, supervisor.SILENT_S, is ten of these).
COMMIT_CHECK_S = 1.0
HEARTBEAT = b"alive\n"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fluxora_webhooks.worker")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--ready-fd", type=int, required=True)
    parser.add_argument("--supervisor", type=int, required=True, help="the supervisor's pid")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    env = dict(os.environ)
    # Before the settings are read: what reading them logs (a short secret) is a record
    # in the run's format too. The supervisor has validated LOG_FORMAT.
    logs.configure(env.get("LOG_FORMAT", "text").strip().lower() or "text")
    # Both set by the supervisor (see supervisor._worker_env and metrics.WORKER_VARIABLE).
    if not env.get("PROMETHEUS_MULTIPROC_DIR") or env.get("FLUXORA_WORKER") != "1":
        _fatal("started by `fluxora-webhooks run` only")
        return EXIT_CONFIG
    logs.mark_worker(args.index)
    try:
        settings = Settings.from_env(env)
        check_client_certificate(settings)
        service = Service(
            # The supervisor serves the one HTTP endpoint, and the API.
            dataclasses.replace(settings, metrics_port=0, workers=1, api_port=None),
            database_url=env["DATABASE_URL"],
            redis_url=env.get("REDIS_URL") or None,
        )
        service.run_background = args.index == 0
        return run_async(_serve(service, args.ready_fd, args.supervisor))
    except ConfigError as exc:
        _fatal(f"configuration error: {exc}")
        return EXIT_CONFIG
    except SchemaError as exc:
        _fatal(str(exc))
        return EXIT_SCHEMA
    except FluxoraError as exc:
        _fatal(str(exc))
        return 1


def _fatal(message: str) -> None:
    """Why the worker stops: a record in the run's log format (one JSON line among the
    others with LOG_FORMAT=json), with its worker index."""
    logging.getLogger("fluxora_webhooks.worker").critical("%s", message)


async def _serve(service: Service, ready_fd: int, supervisor: int) -> int:
    watchers = [
        asyncio.create_task(_report_ready(service, ready_fd)),
        asyncio.create_task(_watch_supervisor(service, supervisor)),
    ]
    try:
        await service.run()
    finally:
        for task in watchers:
            task.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
    return 0


async def _report_ready(service: Service, fd: int) -> None:
    """One line on the supervisor's pipe once the claim loops run (``ready``); then, as it
    changes, whether this process's commits complete: ``stuck <reason>`` when a COMMIT has
    waited too long (the supervisor's /readyz is then 503), ``flowing`` once none has. Not
    ``flowing`` when the wait ended because a stop abandoned the batch: that commit was
    cancelled, not completed (the supervisor would log that the commits complete again).
    Every COMMIT_CHECK_S with nothing else to say: ``alive``, a heartbeat (the supervisor
    stops counting a worker it has not heard from for a while, and kills one silent for
    much longer: a process stopped or wedged writes nothing, though it does not exit)."""
    try:
        # Never blocking the event loop: a supervisor that stops reading (stopped itself)
        # costs lines once the pipe is full, not this process its deliveries.
        os.set_blocking(fd, False)
        while service.dispatcher is None:  # noqa: ASYNC110 - created inside Service.run
            await asyncio.sleep(0.02)
        dispatcher = service.dispatcher
        await dispatcher.ready.wait()
        _say(fd, b"ready\n")
        said: str | None = None
        while True:
            await asyncio.sleep(COMMIT_CHECK_S)
            try:
                stuck = commits_stuck(dispatcher.commit_wait_s())
            except Exception:  # the heartbeat goes on: a silent worker is killed
                logging.getLogger(__name__).exception("commit wait not read")
                stuck = said
            # Cancelled at the stop (stuck None after a stuck, abandoned): nothing more to
            # say about the commits until the exit.
            cancelled = stuck is None and said is not None and service.abandoned
            if stuck != said and not cancelled:
                _say(fd, b"flowing\n" if stuck is None else f"stuck {stuck}\n".encode())
                said = stuck
            else:
                _say(fd, HEARTBEAT)
    except OSError:
        pass  # the supervisor is gone: the watcher handles it
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


def _say(fd: int, line: bytes) -> None:
    """One line to the supervisor (shorter than PIPE_BUF: written whole or not at all);
    dropped when its pipe is full."""
    with contextlib.suppress(BlockingIOError):
        os.write(fd, line)


async def _watch_supervisor(service: Service, supervisor: int) -> None:
    """A supervisor killed with SIGKILL cannot forward SIGTERM: drain when it is gone (this
    process is then re-parented), so no worker outlives it."""
    while os.getppid() == supervisor:  # noqa: ASYNC110 - nothing signals a parent's death
        await asyncio.sleep(PARENT_CHECK_S)
    logging.getLogger(__name__).warning(
        "the supervisor (pid %d) is gone: this worker stops too", supervisor
    )
    service.stop()


if __name__ == "__main__":
    sys.exit(main())
