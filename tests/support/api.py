"""The management API in a test: served by uvicorn in the test's loop on a free port, with
tokens of every kind, and a small JSON client."""

from __future__ import annotations

import contextlib
import ipaddress
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import psycopg
from multidict import CIMultiDict

from fluxora_webhooks import tokens
from fluxora_webhooks.api import ApiConfig, ApiServer

LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"),)


@dataclass
class Reply:
    status: int
    body: Any
    headers: dict[str, str]
    text: str

    @property
    def error_code(self) -> str:
        """The error's code; the error shape is asserted on the way."""
        assert isinstance(self.body, dict) and set(self.body) == {"error"}, self.text
        assert set(self.body["error"]) == {"code", "message"}, self.text
        assert isinstance(self.body["error"]["message"], str) and self.body["error"]["message"]
        return str(self.body["error"]["code"])


@dataclass
class Api:
    """A running API and its tokens: ``admin``, ``reader`` (admin, read-only), ``acme`` and
    ``bolt`` (tenants), ``acme_reader`` (tenant, read-only), ``default`` ('' tenant)."""

    url: str
    session: aiohttp.ClientSession
    database_url: str
    tokens: dict[str, str] = field(default_factory=dict)
    seen: list[str] = field(default_factory=list)  # every body received, for secret scans
    server: ApiServer | None = None

    async def call(
        self,
        method: str,
        path: str,
        *,
        token: str | None = "admin",
        json: Any = None,
        params: dict[str, Any] | None = None,
        data: str | None = None,
        headers: dict[str, str] | list[tuple[str, str]] | None = None,
    ) -> Reply:
        sent = CIMultiDict(headers or {})  # a list: a header repeated
        if token is not None:
            sent["Authorization"] = f"Bearer {self.tokens.get(token, token)}"
        if data is not None:
            sent.setdefault("Content-Type", "application/json")
        async with self.session.request(
            method, self.url + path, json=json, params=params, data=data, headers=sent
        ) as resp:
            text = await resp.text()
            self.seen.append(text)
            body: Any = None
            if resp.content_type == "application/json" and text:
                body = await resp.json()
            headers_seen = {k.lower(): v for k, v in resp.headers.items()}
            return Reply(resp.status, body, headers_seen, text)

    async def get(self, path: str, **kw: Any) -> Reply:
        return await self.call("GET", path, **kw)

    async def post(self, path: str, **kw: Any) -> Reply:
        return await self.call("POST", path, **kw)

    async def all_pages(self, path: str, *, token: str = "admin", **params: Any) -> list[Any]:
        """Every item of a list, page by page (``limit`` small, to cross pages)."""
        items: list[Any] = []
        cursor: str | None = None
        while True:
            query = {**params, **({"cursor": cursor} if cursor else {})}
            reply = await self.get(path, token=token, params=query)
            assert reply.status == 200, reply.text
            assert set(reply.body) == {"data", "next_cursor"}
            items.extend(reply.body["data"])
            cursor = reply.body["next_cursor"]
            if cursor is None:
                return items


TOKENS = {
    "admin": (None, False),
    "reader": (None, True),
    "acme": ("acme", False),
    "acme_reader": ("acme", True),
    "bolt": ("bolt", False),
    "default": ("", False),
}


async def make_tokens(database_url: str) -> dict[str, str]:
    made = {}
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        for name, (tenant, read_only) in TOKENS.items():
            _, text = await tokens.create(conn, name=name, tenant=tenant, read_only=read_only)
            made[name] = text
    return made


@contextlib.asynccontextmanager
async def serving(
    database_url: str, redis_url: str | None = None, prefix: str = "", **options: Any
) -> AsyncIterator[Api]:
    """``options``: more of ApiConfig's fields."""
    config = ApiConfig(
        database_url=database_url,
        redis_url=redis_url,
        redis_prefix=prefix,
        allowed_networks=LOOPBACK,
        **options,
    )
    server = ApiServer(config, "127.0.0.1", 0)
    await server.start()
    try:
        async with aiohttp.ClientSession() as session:
            api = Api(server.url.rstrip("/"), session, database_url, server=server)
            api.tokens = await make_tokens(database_url)
            yield api
    finally:
        await server.stop()
