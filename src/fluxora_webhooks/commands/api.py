"""``fluxora-webhooks api``: the management API and the dashboard on their own, on
``WEBHOOK_API_HOST:WEBHOOK_API_PORT`` (default 127.0.0.1:8080), until SIGTERM/SIGINT/SIGQUIT.
``run`` serves the same beside its dispatcher when ``WEBHOOK_API_PORT`` is set."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError
from .common import check_database, engines, run_async

NAME = "api"
HELP = "serve the management API and the dashboard"
DESCRIPTION = (
    "The REST API under /api/v1 (OpenAPI document at /api/v1/openapi.json) and the "
    "dashboard at /, on WEBHOOK_API_HOST:WEBHOOK_API_PORT (default 127.0.0.1:8080). Every "
    "request needs a token from `fluxora-webhooks tokens create`. Needs DATABASE_URL (the "
    "embedded engines otherwise); REDIS_URL only for the breaker readings."
)
API_EXTRA = "fluxora-webhooks[api]"
DEFAULT_PORT = 8080
# A breaker that nobody has: read at start-up to find out whether REDIS_URL can be read.
CHECK_URL = "https://fluxora-check.invalid/"


def configure(parser: argparse.ArgumentParser) -> None:
    return None


def require_api_extra(variable: str = "WEBHOOK_API_PORT") -> None:
    """Stop at once, naming the extra, when FastAPI or uvicorn is missing."""
    import importlib.util

    missing = [m for m in ("fastapi", "uvicorn", "jinja2") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(
            variable, f"the API needs {API_EXTRA} ({', '.join(missing)} not installed)"
        )


def run(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    import asyncio
    import contextlib
    import logging
    import signal

    from .. import logs
    from ..host import STOP_SIGNALS, early_stop, stopped_by
    from ..settings import Settings, register_engine_secrets, warn_unknown_variables

    settings = Settings.from_env(env)
    logs.configure(settings.log_format)
    warn_unknown_variables(env)
    log = logging.getLogger("fluxora_webhooks.api")
    require_api_extra()
    database_url, _ = engines(env, redis=False)
    redis_url = settings.redis_url  # only what is configured: readings, never the gate
    register_engine_secrets(database_url, redis_url)

    from ..api import ApiConfig, ApiServer

    config = ApiConfig.from_settings(settings, database_url=database_url, redis_url=redis_url)
    port = settings.api_port if settings.api_port is not None else DEFAULT_PORT

    async def checks() -> None:
        # A missing or other schema: exit 3, saying what to run.
        await check_database(database_url, session=True, connect_timeout=10)
        if redis_url:  # one that can never work: exit 2 (one that is down: shown, as before)
            from ..redis_connect import check_usable
            from ..redis_gate import breaker_key

            reading = ("HGETALL", breaker_key(CHECK_URL, settings.redis_prefix))
            await check_usable(redis_url, [reading])

    async def main() -> int:
        server = ApiServer(config, settings.api_host, port)
        stop = asyncio.Event()
        forced = asyncio.Event()  # a second signal: requests in flight are cut off

        def on_signal(sig: signal.Signals) -> None:
            if stop.is_set():
                forced.set()
                return
            log.info(
                "stopping%s: finishing the requests in flight (a second signal stops at once)",
                stopped_by(sig),
            )
            stop.set()

        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, on_signal, sig)
        if (early := early_stop()) is not None:
            on_signal(early)
        # The checks (a database that does not answer: up to its connect timeout) run
        # while a stop signal is heard: it ends them, as it ends `run`'s wait.
        checking = asyncio.ensure_future(checks())
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({checking, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not checking.done():
            checking.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await checking
        stopping.cancel()
        if stop.is_set():
            return 0  # stopped before it served: nothing in flight, no "serving on" line
        checking.result()  # a check's refusal: its exit code and message
        web = await _serve_metrics(settings) if "WEBHOOK_METRICS_PORT" in env else None
        try:
            await server.start()
        except BaseException:
            if web is not None:
                await web.cleanup()
            raise
        if settings.log_format == "text":
            # With LOG_FORMAT=json every line is a JSON record (a container's log collector
            # reads standard output and error as one stream): the record above says it.
            print(f"fluxora-webhooks api: serving on {server.url} (API under /api/v1)", flush=True)
        try:
            await stop.wait()
        finally:
            await server.stop(forced=forced)
            if web is not None:
                await web.cleanup()
        return 0

    return run_async(main())


async def _serve_metrics(settings: Any) -> Any:
    """The API's request series on WEBHOOK_METRICS_HOST:WEBHOOK_METRICS_PORT, only when
    WEBHOOK_METRICS_PORT is set (``run``'s default port is often taken by a ``run`` beside
    it); not on the API's own port, which says nothing about the deployment without a token.
    0 turns it off, as for ``run``."""
    from aiohttp import web
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    from .. import metrics
    from .._version import __version__
    from ..service import serve_health

    if not settings.metrics_port:
        return None
    metrics.without_created_series()
    registry = CollectorRegistry()
    metrics.API_BUILD_INFO.labels(version=__version__).set(1)
    for own in (metrics.API_BUILD_INFO, metrics.API_REQUESTS, metrics.API_REQUEST_DURATION):
        registry.register(own)

    async def scrape(request: web.Request) -> web.Response:
        body = generate_latest(registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    runner, _ = await serve_health(settings, metrics=scrape)
    return runner
