"""The API's request series (``fluxora_api_requests_total``,
``fluxora_api_request_duration_seconds``): every answer the server gives, errors, 413s,
429s and the dashboard's pages included, counted by its route's template (as the router
left it in the scope it routed)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from .. import metrics

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Any]]
Send = Callable[[Any], Awaitable[None]]

# Where a layer that routes a scope of its own (Guard's HEAD as GET) leaves it.
ROUTED = "fluxora.routed"
# The label of a request answered before routing (408, 413, 429) or that no route takes
# (404): its path is never a label.
UNROUTED = "none"


def route_of(scope: Scope, path: str, root_path: str, prefix: str = "") -> str:
    """The template of the route that answered ``scope`` (``/api/v1/endpoints/{endpoint_id}``),
    as the router left it in the scope; a mount's prefix for its files; else
    :data:`UNROUTED`. ``path`` and ``root_path``: the request's, before routing;
    ``prefix``: the one its routers are included under."""
    route = scope.get("route")
    if route is not None:
        template = str(getattr(route, "path_format", None) or getattr(route, "path", UNROUTED))
        # FastAPI's routes included under a prefix carry the prefix in their path in some
        # versions and not in others: it is put back.
        if prefix and path.startswith(prefix + "/") and not template.startswith(prefix + "/"):
            template = prefix + template
        return template
    mounted = str(scope.get("root_path", ""))
    if mounted != root_path and mounted.startswith(root_path):
        return mounted[len(root_path) :]
    return UNROUTED


class Measured:
    """Outermost: counts each answer and times it from the request's arrival to the end of
    its body. A request whose client went away before any answer is not counted."""

    def __init__(
        self, app: Callable[[Scope, Receive, Send], Awaitable[None]], prefix: str = ""
    ) -> None:
        self.app = app
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        method = scope.get("method", "")
        path, root_path = str(scope.get("path", "")), str(scope.get("root_path", ""))
        status: list[int] = []

        async def watched(message: Any) -> None:
            if message["type"] == "http.response.start":
                status.append(int(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            if status:
                method = method if method in metrics.API_METHODS else "other"
                # The router wrote its choice in the scope it routed.
                route = route_of(scope.get(ROUTED, scope), path, root_path, self.prefix)
                metrics.API_REQUESTS.labels(method=method, route=route, status=status[0]).inc()
                metrics.API_REQUEST_DURATION.labels(method=method, route=route).observe(
                    time.perf_counter() - started
                )
