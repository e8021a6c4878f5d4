"""``fluxora-webhooks run``: the dispatcher as a service (configuration from the
environment; see :mod:`fluxora_webhooks.service`)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Mapping

from .common import engines, run_async

NAME = "run"
HELP = "run the dispatcher (configuration from the environment)"


def configure(parser: argparse.ArgumentParser) -> None:
    return None


def run(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    return serve(env)


def serve(env: Mapping[str, str], *, clock: Callable[[], float] = time.time) -> int:
    """Validate, then run the service until a signal; ``clock`` is the dispatcher's wall
    clock (tests run a dispatcher whose clock is hours off)."""
    from .. import logs
    from ..service import Service
    from ..settings import (
        Settings,
        check_builtin_pairs,
        check_client_certificate,
        warn_unknown_variables,
    )

    check_builtin_pairs(env)  # first: a secret it refuses is not warned about as short
    settings = Settings.from_env(env)
    check_client_certificate(settings)
    logs.configure(settings.log_format)
    warn_unknown_variables(env)
    database_url, redis_url = engines(env, redis=True)
    if settings.workers > 1:
        from ..supervisor import Supervisor

        supervisor = Supervisor(
            settings, database_url=database_url, redis_url=redis_url, env=dict(env)
        )

        async def supervise() -> int:
            await supervisor.run()
            return supervisor.exit_code

        return run_async(supervise())
    service = Service(settings, database_url=database_url, redis_url=redis_url, clock=clock)

    async def main() -> int:
        await service.run()
        return 0

    return run_async(main())
