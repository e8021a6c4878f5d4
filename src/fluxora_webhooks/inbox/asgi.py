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
answers: 200 processed or duplicate, 401 refused, 400 malformed, 500/503 rolled back.
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
from ._glue import ConnectionSource, Verification, connector, deliver

__all__ = ["Handler", "inbox_endpoint"]

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
) -> Callable[[Request], Awaitable[Response]]:
    """A Starlette/FastAPI endpoint that receives webhooks into the inbox and applies
    them once. Arguments as for :func:`fluxora_webhooks.inbox.aiohttp.inbox_handler`."""
    connect = connector(connection)
    verification = Verification(secret, previous_secret, tolerance_s, scheme)

    async def endpoint(request: Request) -> Response:
        body = await request.body()

        async def apply(event: InboxEvent, conn: psycopg.AsyncConnection[Any]) -> object:
            return await handler(event, conn, request)

        answer = await deliver(connect, verification, apply, body=body, headers=request.headers.raw)
        return JSONResponse(answer.body, status_code=answer.status)

    return endpoint
