"""What every route depends on: a database connection from the pool, the caller's token
(401 without a valid one), write access (403 for a read-only token) and the tenant scope."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Any

import psycopg
from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from psycopg_pool import AsyncConnectionPool

from .. import logs, tokens
from ..migrations import discard
from ..tokens import Principal
from .errors import ApiError, unauthorized
from .ratelimit import proven

# Failed authentications (an API request without a token or with one that is not valid, a
# dashboard sign-in with a wrong token) are answered no faster than this many a second in
# all, each waiting its turn: a client that retries them in a loop, or guesses tokens,
# costs the process (the dispatcher's loop too, in `run`) and the database a bounded rate,
# while requests with a valid token are not slowed. Nothing locks a token or an address out.
FAILED_AUTH_PER_S = 20.0
# The longest a failed authentication waits for its turn (or two turns, if longer); past
# it, it is answered at once.
MAX_FAILED_AUTH_WAIT_S = 2.0


class FailureThrottle:
    """Spaces failed authentications :attr:`interval_s` apart (a sleep each, no CPU)."""

    def __init__(self, per_s: float) -> None:
        self.interval_s = 1.0 / per_s if per_s > 0 else 0.0
        self._next = 0.0

    async def wait(self) -> None:
        now = time.monotonic()
        turn = max(now, self._next)
        if turn - now > max(MAX_FAILED_AUTH_WAIT_S, 2 * self.interval_s):
            # A queue that long is a flood (clients that do not wait for their answer
            # book turns too): answered at once, so that a turn is never minutes away.
            return
        self._next = turn + self.interval_s
        if turn > now:
            await asyncio.sleep(turn - now)


@dataclass
class ApiState:
    """What the app holds while it runs (``app.state.fluxora``)."""

    pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]]
    config: Any  # ApiConfig (app.py), kept untyped here to keep the import one-way
    failures: FailureThrottle = field(default_factory=lambda: FailureThrottle(FAILED_AUTH_PER_S))

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """A pool connection for a route or a page. One that found the database read-only
        (a standby) is discarded, not handed to the next request (answered 503)."""
        async with self.pool.connection() as conn:
            try:
                yield conn
            except psycopg.errors.ReadOnlySqlTransaction:
                await discard(conn)
                raise


def api_state(request: Request) -> ApiState:
    state: ApiState = request.app.state.fluxora
    return state


async def connection(request: Request) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    async with api_state(request).connection() as conn:
        yield conn


Conn = Annotated[psycopg.AsyncConnection[Any], Depends(connection)]
_bearer = HTTPBearer(auto_error=False, description="a token from `fluxora-webhooks tokens create`")


async def bearer_token(
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> str:
    """The request's bearer token, or 401 before the request takes a database connection:
    a flood of requests without a token, or with one that cannot be a token, costs the
    pool nothing (its 401 waits its turn, :data:`FAILED_AUTH_PER_S`, in errors.py, once
    the request's connection, if it took one, is back in the pool)."""
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise unauthorized()
    text = credentials.credentials.strip()
    if not text or len(text) > tokens.MAX_TOKEN_LENGTH:
        raise unauthorized("the token is not valid (unknown or revoked)")
    return text


async def principal(
    request: Request,
    text: Annotated[str, Depends(bearer_token)],
    conn: Conn,
) -> Principal:
    found = await tokens.authenticate(conn, text)
    if found is None:
        raise unauthorized("the token is not valid (unknown or revoked)")
    logs.add_sensitive(text)  # a live token: never written, whatever logs it (bounded set)
    proven(request.scope, f"token {found.name!r}")  # its own rate limit bucket
    return found


Reader = Annotated[Principal, Depends(principal)]


async def writer(who: Reader) -> Principal:
    if who.read_only:
        raise ApiError(403, "read_only", "this token is read-only")
    return who


Writer = Annotated[Principal, Depends(writer)]


def scoped(who: Principal, requested: str | None) -> str | None:
    """The tenant a call is restricted to: an admin's filter (None: every tenant), or a
    tenant token's own tenant. A tenant token naming another tenant gets 403."""
    if who.tenant is None:
        return requested
    if requested is not None and requested != who.tenant:
        raise ApiError(403, "tenant_forbidden", "this token acts for its own tenant only")
    return who.tenant


# The attribute of a route holding the query parameters it takes (its own and its
# dependencies'), worked out at its first request with any.
_QUERY_NAMES = "_fluxora_query_names"


def _query_names(dependant: Any) -> frozenset[str]:
    names: set[str] = set()
    stack = [dependant]
    while stack:
        current = stack.pop()
        names.update(param.alias for param in current.query_params)
        stack.extend(current.dependencies)
    return frozenset(names)


async def known_query(request: Request, who: Reader) -> None:
    """A query parameter the route does not take is refused (422), after the token is
    checked: a misspelt filter (``?endpoint=`` for ``?endpoint_id=``) would otherwise be
    ignored, and the whole list answered as if it matched."""
    del who  # the token first: an unauthenticated request is told 401, not this
    route = request.scope.get("route")
    dependant = getattr(route, "dependant", None)
    if dependant is None or not request.query_params:
        return
    known: frozenset[str] | None = getattr(route, _QUERY_NAMES, None)
    if known is None:
        known = _query_names(dependant)
        setattr(route, _QUERY_NAMES, known)
    unknown = sorted(set(request.query_params.keys()) - known)
    if unknown:
        takes = ", ".join(sorted(known)) if known else "none"
        shown = ", ".join(repr(name[:40]) for name in unknown[:5])
        raise ApiError(
            422,
            "validation_error",
            f"unknown query parameter {shown} (this path takes: {takes})",
        )
