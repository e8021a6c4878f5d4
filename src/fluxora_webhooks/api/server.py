"""Serve the app with uvicorn inside the caller's asyncio loop (``run`` beside its
dispatcher, ``fluxora-webhooks api`` and the demo on their own).

Uvicorn's own signal handling is off: the caller owns SIGTERM/SIGINT and stops the server
with :meth:`ApiServer.stop`, whose bound keeps the service's drain bound. The socket is
bound here, before uvicorn starts, so a port in use is an error at once (uvicorn would
exit the process) and port 0 gives a free port, read back as :attr:`ApiServer.port`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator

import uvicorn

from ..settings import cannot_listen
from .app import ApiConfig, create_app

log = logging.getLogger("fluxora_webhooks.api")

STOP_TIMEOUT_S = 3.0


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the service handles the signals


class ApiServer:
    def __init__(self, config: ApiConfig, host: str = "127.0.0.1", port: int = 8080) -> None:
        self.config = config
        self.host = host
        self.port = port
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._socket: socket.socket | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    async def start(self) -> None:
        """Bind, start serving and return once the app has started (its pool open)."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted connections inherit it: a response written in two parts (head, body)
        # must not wait for the client's delayed ACK (40 ms a request otherwise).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.bind((self.host, self.port))
        except (OSError, UnicodeError) as exc:
            sock.close()
            raise cannot_listen("API", self.host, self.port, exc) from None
        sock.listen(128)
        sock.setblocking(False)
        self._socket = sock
        self.port = int(sock.getsockname()[1])
        uv_config = uvicorn.Config(
            create_app(self.config),
            log_config=None,  # our handler (and its scrubbing) writes uvicorn's lines too
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=int(STOP_TIMEOUT_S),
            server_header=False,
        )
        self._server = _Server(uv_config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="fluxora-api")
        while not self._server.started:
            if self._task.done():
                self._task.result()  # the app failed to start: raise why
                raise RuntimeError("the API server stopped while starting")
            await asyncio.sleep(0.02)
        log.info("management API and dashboard on %s", self.url)

    async def stop(self, timeout_s: float = STOP_TIMEOUT_S + 2) -> None:
        """Stop accepting, let requests in flight finish (bounded), close the pool."""
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
        except TimeoutError:
            self._server.force_exit = True
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        except Exception:
            log.exception("the API server failed while stopping")
        finally:
            if self._socket is not None:
                self._socket.close()
            self._server = None
            self._task = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()
