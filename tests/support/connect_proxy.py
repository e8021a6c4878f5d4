"""A real HTTP proxy on loopback that tunnels ``CONNECT`` requests, as Squid or an egress
proxy does: it records each request's target and Proxy-Authorization, may require a
user and password (407 otherwise), may refuse targets (403) and may answer a tunnel's
``CONNECT`` with other bytes than its usual 200 (``answer``, written a part at a time)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
from dataclasses import dataclass, field
from urllib.parse import quote


@dataclass
class ConnectProxy:
    credentials: tuple[str, str | bytes] | None = None  # required user and password
    refuse: bool = False  # answer every CONNECT 403
    answer: tuple[bytes, ...] = (b"HTTP/1.1 200 Connection established\r\n\r\n",)
    targets: list[str] = field(default_factory=list)
    authorizations: list[str | None] = field(default_factory=list)
    port: int = 0  # 0: any free port

    async def __aenter__(self) -> ConnectProxy:
        self._tasks: set[asyncio.Task[None]] = set()
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    @property
    def shown(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        if self.credentials is None:
            return f"http://127.0.0.1:{self.port}"
        user, password = self.credentials
        if isinstance(password, bytes):
            password = quote(password, safe="")
        return f"http://{user}:{password}@127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._tunnel(reader, writer)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            self._tasks.discard(task)
            writer.close()

    async def _tunnel(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        method, target, _ = head[0].split(" ", 2)
        fields = dict(
            (name.strip().lower(), value.strip())
            for name, _, value in (line.partition(":") for line in head[1:] if line)
        )
        self.targets.append(target)
        self.authorizations.append(fields.get("proxy-authorization"))
        if method != "CONNECT":
            writer.write(b"HTTP/1.1 405 Method Not Allowed\r\ncontent-length: 0\r\n\r\n")
            return
        if self.credentials is not None:
            user, password = self.credentials
            secret = password if isinstance(password, bytes) else password.encode()
            token = base64.b64encode(user.encode() + b":" + secret).decode()
            if fields.get("proxy-authorization") != f"Basic {token}":
                writer.write(
                    b"HTTP/1.1 407 Proxy Authentication Required\r\n"
                    b'proxy-authenticate: Basic realm="egress"\r\ncontent-length: 0\r\n\r\n'
                )
                return
        if self.refuse:
            writer.write(b"HTTP/1.1 403 Forbidden\r\ncontent-length: 0\r\n\r\n")
            return
        host, _, port = target.rpartition(":")
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(
                host.strip("[]"), int(port)
            )
        except OSError:  # the consumer cannot be reached: a proxy says so
            writer.write(b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\n\r\n")
            return

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            with contextlib.suppress(OSError):
                dst.write_eof()

        try:
            for part in self.answer:
                writer.write(part)
                await writer.drain()
            await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))
        finally:
            upstream_writer.close()
