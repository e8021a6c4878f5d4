"""``fluxora-webhooks run``: the dispatcher as a service.

Start-up: validated settings -> engines -> schema check -> Redis gate -> dispatcher and the
HTTP endpoint (``/metrics``, ``/healthz``, ``/readyz``). SIGTERM/SIGINT: stop claiming, let
the in-flight batch finish (bounded by the request timeout plus a grace period), close
connections, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Any

import psycopg
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from . import metrics
from .dispatcher import Dispatcher
from .errors import SchemaError
from .gate import DeliveryGate, OpenGate
from .migrations import check_schema
from .settings import Settings

log = logging.getLogger("fluxora_webhooks.service")

DRAIN_GRACE_S = 5.0
GAUGE_REFRESH_S = 5.0


async def connect_gate(settings: Settings, redis_url: str) -> DeliveryGate:
    """The Redis gate (rate limit + breaker); it fails open by itself when Redis is down."""
    from .redis_gate import connect_gate as connect_redis_gate

    return await connect_redis_gate(
        redis_url,
        retry_rps=settings.retry_rps,
        breaker_threshold=settings.circuit_breaker_threshold,
        breaker_reset_ms=settings.circuit_breaker_reset_ms,
        probe_ttl_ms=settings.timeout_ms + 5_000,
        prefix=settings.redis_prefix,
    )


class Service:
    def __init__(self, settings: Settings, *, database_url: str, redis_url: str | None) -> None:
        self.settings = settings
        self.database_url = database_url
        self.redis_url = redis_url
        self.dispatcher: Dispatcher | None = None
        self._schema_ok_at = 0.0
        self._web: web.AppRunner | None = None
        self.metrics_port: int | None = None

    async def check(self) -> None:
        """Refuse to start on a missing, older or newer schema."""
        async with await psycopg.AsyncConnection.connect(
            self.database_url, autocommit=True, connect_timeout=10
        ) as conn:
            await check_schema(conn)

    async def run(self, *, install_signals: bool = True) -> None:
        await self.check()
        gate: DeliveryGate = (
            await connect_gate(self.settings, self.redis_url) if self.redis_url else OpenGate()
        )
        self.dispatcher = Dispatcher(self.settings, conninfo=self.database_url, gate=gate)
        loop = asyncio.get_running_loop()
        if install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.stop)
        if self.settings.metrics_port:
            await self._start_http()
        gauges = asyncio.create_task(self._refresh_gauges(), name="fluxora-gauges")
        task = asyncio.create_task(self.dispatcher.run(), name="fluxora-dispatcher")
        log.info(
            "dispatching (batch %d, %d claim loops, poll %d ms)",
            self.settings.batch_size,
            self.settings.claim_loops,
            self.settings.poll_interval_ms,
        )
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            pass
        finally:
            if not task.done():
                self.dispatcher.stop()
                bound = self.settings.timeout_ms / 1000 + DRAIN_GRACE_S
                try:
                    await asyncio.wait_for(asyncio.shield(task), bound)
                except TimeoutError:
                    log.error("drain exceeded %.1fs; abandoning in-flight batch", bound)
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            gauges.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await gauges
            await gate.close()
            if self._web is not None:
                await self._web.cleanup()
            if install_signals:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(sig)
        log.info("stopped")

    def stop(self) -> None:
        if self.dispatcher is not None and not self.dispatcher.stopping:
            log.info("stopping: finishing the in-flight batch")
            self.dispatcher.stop()

    # -- HTTP endpoint ---------------------------------------------------------------

    async def _start_http(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        self._web = web.AppRunner(app, access_log=None)
        await self._web.setup()
        site = web.TCPSite(self._web, self.settings.metrics_host, self.settings.metrics_port)
        await site.start()
        server: Any = site._server
        self.metrics_port = server.sockets[0].getsockname()[1]
        log.info(
            "metrics and health on http://%s:%d", self.settings.metrics_host, self.metrics_port
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(metrics.REGISTRY)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _readyz(self, request: web.Request) -> web.Response:
        try:
            async with asyncio.timeout(3):
                await self.check()
        except SchemaError as exc:
            return web.json_response({"status": "not ready", "reason": str(exc)}, status=503)
        except (psycopg.Error, OSError, TimeoutError) as exc:
            return web.json_response(
                {"status": "not ready", "reason": f"database unreachable ({type(exc).__name__})"},
                status=503,
            )
        if self.dispatcher is None or self.dispatcher.stopping:
            return web.json_response({"status": "not ready", "reason": "stopping"}, status=503)
        return web.json_response({"status": "ready"})

    async def _refresh_gauges(self) -> None:
        while True:
            try:
                await refresh_gauges(self.database_url)
            except (psycopg.Error, OSError) as exc:
                log.debug("gauge refresh failed: %s", type(exc).__name__)
            await asyncio.sleep(GAUGE_REFRESH_S)


async def refresh_gauges(database_url: str) -> None:
    """Backlog gauges from the partial index: cheap however many processed rows exist."""
    async with await psycopg.AsyncConnection.connect(
        database_url, autocommit=True, connect_timeout=5
    ) as conn:
        cur = await conn.execute(
            "SELECT count(*),"
            " COALESCE(EXTRACT(EPOCH FROM now() - min(created_at)"
            " FILTER (WHERE created_at <= now())), 0)"
            " FROM webhook_outbox WHERE NOT processed"
        )
        row = await cur.fetchone()
        assert row is not None
        metrics.OUTBOX_PENDING.set(int(row[0]))
        metrics.OUTBOX_OLDEST_DUE_AGE.set(float(row[1]))
        cur = await conn.execute("SELECT count(*) FROM webhook_dead_letter WHERE state = 'dead'")
        dead = await cur.fetchone()
        assert dead is not None
        metrics.DEAD_LETTER_ROWS.set(int(dead[0]))
