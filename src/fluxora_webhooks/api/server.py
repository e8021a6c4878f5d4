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
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ..settings import cannot_listen
from .app import ApiConfig, create_app

log = logging.getLogger("fluxora_webhooks.api")

STOP_TIMEOUT_S = 3.0
# A client has this long, from its connection or the first byte of a request, to send the
# request's whole head (line and headers); one that trickles it, or connects and sends
# nothing, is disconnected (408 when it had started), rather than hold a connection and
# its memory for as long as it likes. A body has its own bound (app.BODY_TIMEOUT_S).
HEAD_TIMEOUT_S = 10.0
# The longest request head taken (its line and every header): past it, 431 and the
# connection is closed (the HTTP parser itself sets no bound).
MAX_HEAD_BYTES = 64 * 1024
# Connections open at once: a new one past it is closed at once, so that idle or slow
# clients cannot take every file descriptor of the process (the dispatcher's too, in `run`).
MAX_CONNECTIONS = 1000
# How long a refused client's remaining bytes are read and dropped before the close.
LINGER_S = 2.0
# Seconds an idle keep-alive connection is kept between requests (uvicorn's default).
KEEP_ALIVE_S = 5


def _plain(status: str, text: str) -> bytes:
    body = f"{text}\n".encode()
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: text/plain; charset=utf-8\r\n"
        f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


_REQUEST_TIMEOUT = _plain("408 Request Timeout", "the request head was not sent in time")
_HEAD_TOO_LARGE = _plain("431 Request Header Fields Too Large", "the request head is too large")


class _HeadTooLarge(Exception):
    """Raised in the parser's callbacks: it stops the parser, and uvicorn answers through
    :meth:`_Protocol.send_400_response`."""


class _Protocol(HttpToolsProtocol):
    """Uvicorn's HTTP/1.1 protocol with the bounds it lacks: :data:`HEAD_TIMEOUT_S`,
    :data:`MAX_HEAD_BYTES` and :data:`MAX_CONNECTIONS` (class attributes, for tests).

    A request's head is what the parser reports between a message's begin and its headers'
    end (its URL and headers, counted as parsed), so a body, also one the app did not read
    before answering, is never taken for the next request's head."""

    head_timeout_s = HEAD_TIMEOUT_S
    max_head_bytes = MAX_HEAD_BYTES
    max_connections = MAX_CONNECTIONS

    _head_timer: asyncio.TimerHandle | None = None
    _head_started = False
    _head_bytes = 0
    _too_large = False
    _refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        over = len(self.connections) >= self.max_connections
        super().connection_made(transport)
        if over:
            transport.abort()
            return
        self._arm_head_timer()  # a client that connects and sends nothing

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._refused:
            super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_started = True
        self._head_bytes = 0
        self._disarm_head_timer()
        self._arm_head_timer()

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def _count(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > self.max_head_bytes:
            self._too_large = True
            raise _HeadTooLarge

    def on_headers_complete(self) -> None:
        self._head_started = False
        self._disarm_head_timer()
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        if self._too_large:
            self._refuse(_HEAD_TOO_LARGE)
        else:
            super().send_400_response(msg)

    def _answering(self) -> bool:
        """Whether an earlier request's response is still being sent (pipelining)."""
        return self.cycle is not None and not self.cycle.response_complete

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self._answering():  # a pipelined head waits for the request before it
            self._arm_head_timer()
            return
        self._refuse(_REQUEST_TIMEOUT if self._head_started else b"")

    def _refuse(self, answer: bytes) -> None:
        """Answer (if anything) and close. What the client still sends meanwhile is read
        and dropped for :data:`LINGER_S`, so that the answer is not lost to a reset. While
        an earlier request's response is being sent, only close."""
        self._disarm_head_timer()
        self._refused = True
        if not answer or self._answering() or not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write(answer)
        self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)


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
            http=_Protocol,
            timeout_keep_alive=KEEP_ALIVE_S,
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

    async def stop(
        self, timeout_s: float = STOP_TIMEOUT_S + 2, forced: asyncio.Event | None = None
    ) -> None:
        """Stop accepting, let requests in flight finish (bounded by ``timeout_s``, or until
        ``forced`` is set: a second signal), close the pool."""
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        task = self._task
        waits: set[asyncio.Future[Any]] = {task}
        forcing = asyncio.ensure_future(forced.wait()) if forced is not None else None
        if forcing is not None:
            waits.add(forcing)
        try:
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                why = "a second signal" if forced is not None and forced.is_set() else None
                log.warning(
                    "the API stops with requests still in flight (%s): they are cut off",
                    why or f"the {timeout_s:.0f}s drain bound",
                )
                self._server.force_exit = True
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            elif not task.cancelled() and task.exception() is not None:
                log.error("the API server failed while stopping", exc_info=task.exception())
        finally:
            if forcing is not None:
                forcing.cancel()
            if self._socket is not None:
                self._socket.close()
            self._server = None
            self._task = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()
