"""ASGI glue (Starlette, FastAPI) for the consumer's inbox. Needs the ``asgi`` extra:
``pip install 'fluxora-webhooks[asgi]'``.

::

    from fluxora_webhooks.inbox.asgi import inbox_endpoint

    async def credit(event, conn, request):      # in the inbox's transaction
        await conn.execute("UPDATE balances SET amount = amount + %s",
                           (event.payload["amount"],))

    endpoint = inbox_endpoint(pool, credit, secret=WEBHOOK_SECRET)
    app = Starlette(routes=[Route("/webhooks", endpoint, methods=["POST"])])
    # FastAPI: app.add_api_route("/webhooks", endpoint, methods=["POST"])

The endpoint reads the raw body and the raw header bytes (what was signed, not a
re-decoded copy), then does what :mod:`fluxora_webhooks.inbox.aiohttp` does, with the same
answers: 200 processed or duplicate, 401 refused, 400 malformed, 500/503 rolled back; and 413
for a body over ``max_body_bytes``, which aiohttp applies by itself (``client_max_size``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import psycopg

try:
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "fluxora_webhooks.inbox.asgi needs Starlette: pip install 'fluxora-webhooks[asgi]'"
    ) from exc

from ..signing import DEFAULT_TOLERANCE_SECONDS
from . import InboxEvent
from ._glue import ConnectionSource, Verification, check_handler, connector, deliver

__all__ = ["DEFAULT_MAX_BODY_BYTES", "Handler", "inbox_endpoint"]

DEFAULT_MAX_BODY_BYTES = 1 << 20

#: Your handler: ``await handler(event, conn, request)``; write on ``conn`` (the inbox's
#: transaction). Return to commit; raise to roll back (the sender retries).
Handler = Callable[[InboxEvent, psycopg.AsyncConnection[Any], Request], Awaitable[object]]


def inbox_endpoint(
    connection: ConnectionSource,
    handler: Handler,
    *,
    secret: str | bytes,
    previous_secret: str | bytes | None = None,
    tolerance_s: int = DEFAULT_TOLERANCE_SECONDS,
    scheme: str = "auto",
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> Callable[[Request], Awaitable[Response]]:
    """A Starlette/FastAPI endpoint that receives webhooks into the inbox and applies
    them once. Arguments as for :func:`fluxora_webhooks.inbox.aiohttp.inbox_handler`;
    a body over ``max_body_bytes`` (1 MiB by default, as aiohttp's) is answered 413."""
    connect = connector(connection)
    check_handler(handler)
    verification = Verification(secret, previous_secret, tolerance_s, scheme)
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int):
        raise TypeError("max_body_bytes must be a whole number of bytes")
    if max_body_bytes < 1:
        raise ValueError("max_body_bytes must be at least 1")

    async def endpoint(request: Request) -> Response:
        body = await _read_body(request, max_body_bytes)
        if body is None:
            return JSONResponse({"error": "body_too_large"}, status_code=413)

        async def apply(event: InboxEvent, conn: psycopg.AsyncConnection[Any]) -> object:
            return await handler(event, conn, request)

        answer = await deliver(connect, verification, apply, body=body, headers=request.headers.raw)
        return JSONResponse(answer.body, status_code=answer.status)

    return endpoint


async def _read_body(request: Request, limit: int) -> bytes | None:
    """The raw body, or None once it grows past ``limit`` (the signature cannot be checked
    before the whole body is read, so an unauthenticated sender must not choose its size)."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)
