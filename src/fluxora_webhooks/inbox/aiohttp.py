"""aiohttp glue for the consumer's inbox: a request handler that applies each event once.

::

    from fluxora_webhooks.inbox.aiohttp import inbox_handler

    async def credit(event, conn, request):      # in the inbox's transaction
        await conn.execute("UPDATE balances SET amount = amount + %s",
                           (event.payload["amount"],))

    pool = psycopg_pool.AsyncConnectionPool(DATABASE_URL, open=False)
    app.router.add_post("/webhooks", inbox_handler(pool, credit, secret=WEBHOOK_SECRET))

Per request: read the raw body, verify (a forged request is answered 401 without taking a
connection), then on one connection and in one transaction: :func:`~fluxora_webhooks.inbox.receive`,
your handler (first delivery only), commit. Answers, as JSON:

- 200 ``{"status": "processed"}``: new event, handled and committed;
- 200 ``{"status": "duplicate"}``: already received; 2xx so that the sender stops;
- 401 ``{"error": "verification_failed", "reason": ...}``: bad signature, stale timestamp;
- 400 ``{"error": "bad_request", "reason": ...}``: signed, but not JSON or an unusable id;
- 500 ``{"error": "handler_failed"}`` (your handler raised; logged), 503
  ``{"error": "database_unavailable"}``: rolled back, so the sender retries;
- 413 ``{"error": "body_too_large"}``: a body over the app's ``client_max_size`` (1 MiB by
  default).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
from aiohttp import web

from ..signing import DEFAULT_TOLERANCE_SECONDS
from . import InboxEvent
from ._glue import ConnectionSource, Verification, check_handler, connector, deliver

__all__ = ["Handler", "inbox_handler"]

#: Your handler: ``await handler(event, conn, request)``; write on ``conn`` (the inbox's
#: transaction). Return to commit; raise to roll back (the sender retries).
Handler = Callable[[InboxEvent, psycopg.AsyncConnection[Any], web.Request], Awaitable[object]]


def inbox_handler(
    connection: ConnectionSource,
    handler: Handler,
    *,
    secret: str | bytes,
    previous_secret: str | bytes | None = None,
    tolerance_s: int = DEFAULT_TOLERANCE_SECONDS,
    scheme: str = "auto",
) -> Callable[[web.Request], Awaitable[web.Response]]:
    """An aiohttp handler that receives webhooks into the inbox and applies them once.

    ``connection``: a ``psycopg_pool.AsyncConnectionPool`` (opened by your app), or a
    callable returning an async context manager that yields an ``AsyncConnection``. The
    other arguments are :func:`~fluxora_webhooks.inbox.receive`'s; a bad one raises here.
    """
    connect = connector(connection)
    check_handler(handler)
    verification = Verification(secret, previous_secret, tolerance_s, scheme)

    async def handle(request: web.Request) -> web.Response:
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:  # past the app's client_max_size (1 MiB)
            return web.json_response({"error": "body_too_large"}, status=413)

        async def apply(event: InboxEvent, conn: psycopg.AsyncConnection[Any]) -> object:
            return await handler(event, conn, request)

        answer = await deliver(connect, verification, apply, body=body, headers=request.headers)
        return web.json_response(answer.body, status=answer.status)

    return handle
