"""The ASGI application: the REST API under ``/api/v1`` and the dashboard at ``/``, one
connection pool, one error shape, and the security headers on every response."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import psycopg
from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse
from psycopg_pool import AsyncConnectionPool, PoolTimeout
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request

from .._version import __version__
from ..logs import Notice
from ..pgtypes import SESSION_SETTINGS_SQL, read_deep_json, read_far_timestamps, session_name
from ..settings import API_RATE_LIMIT, Settings
from . import errors
from .deps import FAILED_AUTH_PER_S, ApiState, FailureThrottle, known_query
from .measured import ROUTED, Measured
from .ratelimit import RateLimit

log = logging.getLogger("fluxora_webhooks.api")

API_PREFIX = "/api/v1"
# The largest request body taken (an event's payload with its envelope, a form): as the
# consumers' inbox glue refuses a delivery over 1 MiB, a larger event could only end as
# dead letters.
MAX_BODY_BYTES = 1 << 20
# Scripts and styles from this server only, no inline script or eval, nothing framed.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
# The longest one statement of a read (a GET or HEAD request: the API's lists, the
# statistics, the dashboard's pages) runs: a read that asks too much is stopped and
# answered 422 (errors.py), rather than hold one of the pool's few connections while other
# requests wait for one. Writes (POST, PUT, PATCH, DELETE) run with the session's own
# setting: disabling an endpoint parks each of its pending deliveries in one statement.
READ_STATEMENT_TIMEOUT_MS = 10_000
# How long a request's body may take to arrive whole (from the request's start): a client
# that trickles it is answered 408 and its connection closed. A body is read before the
# request takes a database connection, so a slow one holds no connection of the pool.
BODY_TIMEOUT_S = 30.0
# Whether the request being served reads (set by Guard, read when a connection is taken).
_READING: ContextVar[bool] = ContextVar("fluxora_api_reading", default=False)
# Each pool connection's statement_timeout: as it was set last (not set again while the
# same), and the session's own (the server's, the role's or the URL's) for writes.
_TIMEOUTS: weakref.WeakKeyDictionary[psycopg.AsyncConnection[Any], tuple[str, str]] = (
    weakref.WeakKeyDictionary()
)
SECURITY_HEADERS = (
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-store"),
)


@dataclass(frozen=True)
class ApiConfig:
    """What the API needs: the engines, the URL policy for new endpoints' URLs, and the
    Redis breaker readings' prefix."""

    database_url: str = field(repr=False)
    redis_url: str | None = field(default=None, repr=False)
    redis_prefix: str = ""
    allowed_networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()
    breaker_threshold: int = 0
    pool_max: int = 4
    max_endpoints_per_tenant: int = 0
    body_timeout_s: float = BODY_TIMEOUT_S
    failed_auth_per_s: float = FAILED_AUTH_PER_S
    # Requests per credential: (requests, per ms), a token bucket (ratelimit.py); None: off.
    rate_limit: tuple[int, int] | None = API_RATE_LIMIT

    @classmethod
    def from_settings(
        cls, settings: Settings, *, database_url: str, redis_url: str | None
    ) -> ApiConfig:
        return cls(
            database_url=database_url,
            redis_url=redis_url,
            redis_prefix=settings.redis_prefix,
            allowed_networks=settings.allowed_networks,
            breaker_threshold=settings.circuit_breaker_threshold,
            max_endpoints_per_tenant=settings.max_endpoints_per_tenant,
            rate_limit=settings.api_rate_limit,
        )


ASGIApp = Callable[
    [MutableMapping[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
    Awaitable[None],
]


async def _configure(conn: psycopg.AsyncConnection[Any]) -> None:
    """A time a producer wrote that Python cannot hold (``-infinity``) is read, not a 500
    (pgtypes); the session's DateStyle, isolation and float digits are ours
    (pgtypes.SESSION_SETTINGS)."""
    read_far_timestamps(conn)
    read_deep_json(conn)
    cur = await conn.execute(f"SELECT current_setting('statement_timeout'), {SESSION_SETTINGS_SQL}")
    row = await cur.fetchone()
    own = str(row[0]) if row else "0"
    _TIMEOUTS[conn] = (own, own)


async def _statement_timeout(conn: psycopg.AsyncConnection[Any]) -> None:
    """A connection taken for a read stops a statement after
    :data:`READ_STATEMENT_TIMEOUT_MS`; one taken for a write has the session's own
    setting. Set in the session (the pool's connections are in autocommit), only when it
    changes."""
    current, own = _TIMEOUTS.get(conn, ("", "0"))
    wanted = f"{READ_STATEMENT_TIMEOUT_MS}ms" if _READING.get() else own
    if wanted != current:
        await conn.execute("SELECT set_config('statement_timeout', %s, false)", (wanted,))
        _TIMEOUTS[conn] = (wanted, own)


class _Pool(AsyncConnectionPool[psycopg.AsyncConnection[Any]]):
    """The API's pool: a connection is handed out with the statement timeout of the
    request (:func:`_statement_timeout`)."""

    async def getconn(self, timeout: float | None = None) -> psycopg.AsyncConnection[Any]:
        conn = await super().getconn(timeout=timeout)
        try:
            await _statement_timeout(conn)
        except BaseException:
            await self.putconn(conn)
            raise
        return conn


def _too_large() -> HTTPException:
    return HTTPException(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")


class Guard:
    """Around the whole application: :data:`SECURITY_HEADERS` on every HTTP response
    (static files and errors too); a request body larger than :data:`MAX_BODY_BYTES`
    (declared, or as it arrives) refused with 413 before it is read whole; an exception no
    handler answered logged and answered 500 in the error shape (JSON, or the dashboard's
    page), rather than as the server's plain-text page."""

    def __init__(
        self, app: ASGIApp, html_error: Callable[..., Any], body_timeout_s: float = BODY_TIMEOUT_S
    ) -> None:
        self.app = app
        self.html_error = html_error
        self.body_timeout_s = body_timeout_s

    async def __call__(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[Any]],
        send: Callable[[Any], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        head = scope.get("method") == "HEAD"
        reading = _READING.set(scope.get("method") in ("GET", "HEAD"))
        if head:
            # HEAD is answered as GET without the body (RFC 9110): the routes declare GET.
            # A scope of its own (the server reads the method in its own to send no body),
            # where Measured, around this, finds the route chosen.
            scope[ROUTED] = scope = {**scope, "method": "GET"}
        declared = dict(scope.get("headers", ())).get(b"content-length", b"")
        received = 0
        started = False
        body_done = False
        body_deadline = time.monotonic() + self.body_timeout_s

        async def limited() -> Any:
            nonlocal received, body_done
            if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
                raise _too_large()
            if body_done:  # after the body: a disconnect, whenever it comes
                return await receive()
            try:
                async with asyncio.timeout(body_deadline - time.monotonic()):
                    message = await receive()
            except TimeoutError:
                # The connection is closed after the 408: the rest of its body is not read.
                raise HTTPException(
                    408, "the request body was not sent in time", {"Connection": "close"}
                ) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > MAX_BODY_BYTES:
                    raise _too_large()
                body_done = not message.get("more_body", False)
            else:
                body_done = True
            return message

        async def watched(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                present = {k.lower() for k, _ in message.get("headers", [])}
                extra = [(k, v) for k, v in SECURITY_HEADERS if k not in present]
                message["headers"] = [*message.get("headers", []), *extra]
            elif head and message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        try:
            await self.app(scope, limited, watched)
        except Exception as exc:
            if started:
                raise  # the server logs it; the answer is on its way
            where = f"{scope.get('method')} {scope.get('path')}"
            if isinstance(exc, ClientDisconnect):
                log.info("%s: the client went away while sending its request", where)
                return
            log.exception("%s: unexpected error", where)
            await self._internal_error(scope, receive, watched)
        finally:
            _READING.reset(reading)

    async def _internal_error(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[Any]],
        send: Callable[[Any], Awaitable[None]],
    ) -> None:
        message = "internal error; the server's log has the details"
        response: Any = errors.error_response(500, "internal_error", message)
        if not str(scope.get("path", "")).startswith(errors.API_PREFIX):
            try:
                response = self.html_error(Request(scope), 500, message)
            except Exception:  # the page itself failed: the JSON answer, then
                log.exception("the error page could not be rendered")
        await response(scope, receive, send)


def create_app(config: ApiConfig) -> FastAPI:
    from .dashboard import pages, render
    from .routes import deliveries, endpoints, events, stats

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] = _Pool(
            config.database_url,
            min_size=1,
            max_size=config.pool_max,
            # Unprepared statements get plans for their actual parameters: the optional
            # filters (`%(x)s IS NULL OR ...`) then fold away.
            kwargs={
                "autocommit": True,
                "prepare_threshold": None,
                **session_name(config.database_url, "fluxora-webhooks api"),
            },
            open=False,
            name="fluxora-api",
            configure=_configure,
            # A connection the server closed meanwhile (a restart, a failover, an idle
            # timeout) is replaced when it is taken, not answered 500 once per connection.
            check=AsyncConnectionPool.check_connection,
        )
        await pool.open(wait=True, timeout=30)
        app.state.fluxora = ApiState(
            pool=pool, config=config, failures=FailureThrottle(config.failed_auth_per_s)
        )
        try:
            yield
        finally:
            await pool.close()

    app = FastAPI(
        title="fluxora-webhooks management API",
        version=__version__,
        description="Endpoints, events, deliveries, replay and statistics (SPEC section 15)."
        " Every request needs `Authorization: Bearer <token>`.",
        openapi_url=None,  # served by the route below, behind a token like the rest
        docs_url=None,  # its pages load scripts from a CDN; the document is enough
        redoc_url=None,
        lifespan=lifespan,
        # "/x/" is the JSON 404 of any unknown route, not a redirect: Starlette's would
        # build its Location from the request's Host header.
        redirect_slashes=False,
        responses={
            400: {
                "model": errors_model(),
                "description": "`bad_request`: the body is not JSON; `invalid_cursor`: a cursor"
                " this list did not return",
            },
            401: {
                "model": errors_model(),
                "description": "`unauthorized`: no token, or not a valid one",
                "headers": {
                    "WWW-Authenticate": {
                        "description": "the scheme to authenticate with: Bearer",
                        "required": True,
                        "schema": {"type": "string"},
                    }
                },
            },
            405: {
                "model": errors_model(),
                "description": "`method_not_allowed`: a method the route does not take",
                "headers": {
                    "Allow": {
                        "description": "the methods the path takes",
                        "required": True,
                        "schema": {"type": "string"},
                    }
                },
            },
            408: {
                "model": errors_model(),
                "description": "`request_timeout`: the body did not arrive in time (a"
                " `Content-Length` longer than what was sent)",
            },
            413: {"model": errors_model(), "description": "`too_large`: a body over 1 MiB"},
            415: {
                "model": errors_model(),
                "description": "`unsupported_media_type`: a body sent without"
                " `Content-Type: application/json`",
            },
            422: {
                "model": errors_model(),
                "description": "`validation_error`: the request is not valid (the message names"
                " the field); `query_timeout`: a read that ran longer than the API allows,"
                " narrow it with a filter",
            },
            429: {
                "model": errors_model(),
                "description": "`rate_limited`: more requests than WEBHOOK_API_RATE_LIMIT"
                " allows this token (or, before it has authenticated, its client address)",
                "headers": {
                    "Retry-After": {
                        "description": "seconds until the next request is admitted",
                        "required": True,
                        "schema": {"type": "integer"},
                    }
                },
            },
            431: {
                "description": "the request head (its line and headers) is too large; a plain"
                " text answer, sent before the request is read",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            },
            500: {
                "model": errors_model(),
                "description": "`internal_error`: an unexpected error (in the log);"
                " `database_privilege`: the API's database role lacks a privilege",
            },
            503: {
                "model": errors_model(),
                "description": "`unavailable`: the database is not reachable or read-only: try"
                " again later",
                "headers": {
                    "Retry-After": {
                        "description": "seconds to wait before trying again",
                        "required": True,
                        "schema": {"type": "integer"},
                    }
                },
            },
        },
    )
    for module in (endpoints, events, deliveries, stats):
        app.include_router(module.router, prefix=API_PREFIX, dependencies=[Depends(known_query)])
    pages.install(app)
    errors.install(app, render.error_page)
    # Inside the Guard: a 429 carries the security headers too.
    app.add_middleware(RateLimit, limit=config.rate_limit, html_error=render.error_page)
    app.add_middleware(Guard, html_error=render.error_page, body_timeout_s=config.body_timeout_s)
    # Outermost: the Guard's 413s and 500s are answers too.
    app.add_middleware(Measured, prefix=API_PREFIX)
    _require_token_for_openapi(app)
    if config.rate_limit is not None:
        _declare_rate_limit_headers(app)
    _install_probes(app)
    return app


# The headers RateLimit puts on every answer of a limited path (the document's paths are).
_RATE_LIMIT_HEADERS = {
    "RateLimit-Limit": "requests allowed in the window (WEBHOOK_API_RATE_LIMIT)",
    "RateLimit-Remaining": "requests left in the window for this token (or client address)",
    "RateLimit-Reset": "seconds until the window allows the limit again",
}


def _declare_rate_limit_headers(app: FastAPI) -> None:
    """Each answer of the document names the rate limit's headers (FastAPI has no
    document-wide response headers): the document is made once, then completed."""
    make = app.openapi

    def openapi() -> dict[str, Any]:
        done = app.openapi_schema is not None
        schema = make()
        if not done:
            headers = {
                name: {"description": text, "schema": {"type": "integer"}}
                for name, text in _RATE_LIMIT_HEADERS.items()
            }
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    for answer in operation.get("responses", {}).values():
                        answer.setdefault("headers", {}).update(headers)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


# How long readiness waits for a pool connection and its answer.
READY_TIMEOUT_S = 2.0


def _install_probes(app: FastAPI) -> None:
    """``/healthz`` and ``/readyz`` for a platform's probes, without a token and saying
    nothing about the deployment: the process answers (liveness), and the database answers
    through the pool within READY_TIMEOUT_S (readiness: 503 otherwise, so the platform sends
    the API's traffic elsewhere until it does, without restarting a process that would
    recover by itself)."""
    import asyncio

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    unready = Notice(60.0)
    own_probe = asyncio.Lock()
    own_answer: list[Any] = [float("-inf"), False]  # when, whether the database answered

    @app.get("/readyz", include_in_schema=False)
    async def readyz(request: Request) -> JSONResponse:
        state: ApiState = request.app.state.fluxora
        try:
            async with asyncio.timeout(READY_TIMEOUT_S):
                try:
                    async with state.pool.connection(timeout=READY_TIMEOUT_S / 2) as conn:
                        await conn.execute("SELECT 1")
                except PoolTimeout:
                    # Every connection serving a request, or none made: a connection of
                    # the probe's own tells a busy API (ready: a platform would otherwise
                    # move its load to the others) from a database that does not answer.
                    # One at a time, its answer reused for a second: probes need no token,
                    # and a flood of them must not open a connection each.
                    async with own_probe:
                        if time.monotonic() - own_answer[0] >= 1.0:
                            own_answer[:] = [time.monotonic(), await _own_connection(state)]
                    if not own_answer[1]:
                        return _unready(unready, "no connection could be made")
        except Exception as exc:
            return _unready(unready, type(exc).__name__)
        return JSONResponse({"status": "ok"})


async def _own_connection(state: ApiState) -> bool:
    """Whether the database answers a connection of the probe's own."""
    try:
        async with await psycopg.AsyncConnection.connect(
            state.config.database_url,
            autocommit=True,
            prepare_threshold=None,
            connect_timeout=max(1, int(READY_TIMEOUT_S / 2)),
            **session_name(state.config.database_url, "fluxora-webhooks api"),
        ) as own:
            await own.execute("SELECT 1")
    except Exception:
        return False
    return True


def _unready(notice: Notice, why: str) -> JSONResponse:
    unsaid = notice.due()
    if unsaid is not None:
        more = f"; {unsaid} more since the last such line" if unsaid else ""
        log.warning("readiness: the database did not answer (%s)%s", why, more)
    return JSONResponse({"status": "unavailable"}, status_code=503, headers={"Retry-After": "1"})


def errors_model() -> type[Any]:
    from .models import ErrorBody

    return ErrorBody


def _require_token_for_openapi(app: FastAPI) -> None:
    """The document is served to a caller with a token, like every other API request."""
    from .deps import principal

    @app.get(
        f"{API_PREFIX}/openapi.json", include_in_schema=False, dependencies=[Depends(principal)]
    )
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())
