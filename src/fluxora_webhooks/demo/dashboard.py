"""After the demo: the management API and dashboard over what it just did, with an admin
token of its own, so a newcomer can click through the deliveries, their attempts and the
endpoint. Earlier demo runs' tokens are revoked; the token is printed, never logged."""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import psycopg

from .. import tokens
from ..api import ApiConfig, ApiServer
from ..errors import ConfigError

TOKEN_PREFIX = "demo-admin-"


async def demo_token(database_url: str) -> str:
    """A fresh admin token named demo-admin-..., the older demo tokens revoked."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        for token in await tokens.list_tokens(conn):
            if token.name.startswith(TOKEN_PREFIX) and token.revoked_at is None:
                await tokens.revoke(conn, token.name)
        _, text = await tokens.create(conn, name=TOKEN_PREFIX + secrets.token_hex(4))
    return text


async def start_dashboard(
    database_url: str, redis_url: str | None, host: str, port: int
) -> ApiServer:
    """Serve on ``port``, or on any free port when that one is taken."""
    config = ApiConfig(database_url=database_url, redis_url=redis_url)
    server = ApiServer(config, host, port)
    try:
        await server.start()
    except ConfigError as exc:
        # The port taken (or not allowed); a host that cannot be bound is refused again.
        if exc.variable != "WEBHOOK_API_PORT":
            raise
        server = ApiServer(config, host, 0)
        await server.start()
    return server


async def serve_until_interrupted(server: ApiServer) -> None:
    """Keep serving until Ctrl-C (the command's loop is cancelled) or SIGTERM."""
    import signal

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def describe(url: str, token: str, serving: bool, asked: bool = False) -> list[Any]:
    """The closing lines: ``serving`` (kept running), ``asked`` (--serve was given)."""
    lines = [
        f"Dashboard: {url}  (sign in with the admin token below)",
        f"API: {url}api/v1/stats, its OpenAPI document {url}api/v1/openapi.json"
        " (header Authorization: Bearer <the admin token>)",
        f"Admin token (shown once): {token}",
    ]
    if serving:
        lines.append("Serving until Ctrl-C.")
    else:
        lines.append(
            "Not kept running: --serve keeps it only when the output is a terminal (it is"
            " not here, so a script or CI does not wait); run the demo in a terminal, or"
            " serve it with `fluxora-webhooks api`."
            if asked
            else "Not kept running: keep it with `fluxora-webhooks demo --serve` (in a"
            " terminal), or serve it with `fluxora-webhooks api`."
        )
    return lines
