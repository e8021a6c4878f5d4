"""A real HTTP consumer on loopback that records what it receives and answers as told."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class Received:
    headers: dict[str, str]
    body: bytes
    at: float  # time.time() on receipt

    @property
    def delivery_id(self) -> str:
        return self.headers["x-fluxora-delivery-id"]

    @property
    def attempt(self) -> int:
        return int(self.headers["x-fluxora-attempt"])


Responder = Callable[[Received], Awaitable[web.StreamResponse] | web.StreamResponse]


@dataclass
class Receiver:
    """Answers 200 unless ``respond`` says otherwise."""

    host: str = "127.0.0.1"
    received: list[Received] = field(default_factory=list)
    respond: Responder | None = None
    port: int = 0
    _runner: web.AppRunner | None = None
    _event: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/hook?token=sekrit-query-token"

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/hook", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        item = Received(
            {k.lower(): v for k, v in request.headers.items()}, await request.read(), time.time()
        )
        self.received.append(item)
        self._event.set()
        if self.respond is None:
            return web.Response(status=200, text="ok")
        result = self.respond(item)
        if asyncio.iscoroutine(result):
            result = await result
        assert isinstance(result, web.StreamResponse)
        return result

    def by_delivery(self) -> dict[str, list[Received]]:
        out: dict[str, list[Received]] = {}
        for item in self.received:
            out.setdefault(item.delivery_id, []).append(item)
        return out

    async def wait_for(self, count: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.received) < count:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(
                    f"receiver got {len(self.received)} requests, expected {count}"
                )
            self._event.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._event.wait(), min(remaining, 0.2))


@contextlib.asynccontextmanager
async def answering(status: int, text: str = "") -> AsyncIterator[Receiver]:
    """A started receiver that answers every request ``status`` with ``text``."""
    recv = Receiver()
    recv.respond = lambda r: web.Response(status=status, text=text)
    await recv.start()
    try:
        yield recv
    finally:
        await recv.stop()
