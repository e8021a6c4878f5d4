"""Every error the API answers has one shape, ``{"error": {"code", "message"}}``: ours,
the admin layer's (translated here, in one place), FastAPI's validation errors and the
router's own 404/405. The dashboard's paths get an HTML page instead."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

import psycopg
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from psycopg_pool import PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Mount

from ..errors import (
    ConfigError,
    ConflictError,
    EndpointError,
    EndpointLimitReached,
    IdempotencyKeyReused,
    NotFoundError,
)
from ..migrations import READ_ONLY_HINT

API_PREFIX = "/api/"
# A 503's Retry-After (seconds): a restart or a failover is over in about this long.
RETRY_AFTER_S = 5
# The 503 answers' log lines: the first of each reason, then at most one per this many
# seconds, with the count of those answered meanwhile (a pool with no connection free
# answers every waiting request 503: one line each would flood the log).
UNAVAILABLE_LOG_EVERY_S = 10.0
log = logging.getLogger("fluxora_webhooks.api")
# The methods a 405's Allow can name (HEAD is added with GET).
_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")

_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    409: "conflict",
    413: "too_large",
    415: "unsupported_media_type",
    422: "validation_error",
    429: "rate_limited",
    500: "internal_error",
    503: "unavailable",
}


class ApiError(Exception):
    """An error answered as is: its status, code and message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


def unauthorized(message: str = "a valid bearer token is required") -> ApiError:
    return ApiError(401, "unauthorized", message)


def error_response(
    status: int, code: str, message: str, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    sent = dict(headers or {})
    if status == 401:
        sent["WWW-Authenticate"] = 'Bearer realm="fluxora-webhooks"'
    return JSONResponse(
        {"error": {"code": code, "message": message}}, status_code=status, headers=sent or None
    )


def _validation_message(
    exc: RequestValidationError, content_type: str = "application/json"
) -> tuple[int, str, str]:
    errors: list[Any] = list(exc.errors())
    if any(e.get("type") == "json_invalid" for e in errors):
        return 400, "bad_request", "the request body is not valid JSON"
    media = content_type.split(";", 1)[0].strip().lower()
    body_errors = [e for e in errors if tuple(e.get("loc", ())) == ("body",)]
    if not media and any(e.get("type") != "missing" for e in body_errors):
        # A body sent without a Content-Type is not read as JSON either (no body at all
        # stays a missing field).
        return (
            415,
            "unsupported_media_type",
            "the request body must be JSON, sent with Content-Type: application/json"
            " (no Content-Type was sent)",
        )
    foreign = media and media != "application/json" and not media.endswith("+json")
    if foreign and body_errors:
        # FastAPI reads a body of another media type as no JSON at all.
        shown = media[:60]
        return (
            415,
            "unsupported_media_type",
            (
                f"the request body must be JSON, sent with Content-Type: application/json"
                f" (got {shown})"
            ),
        )
    parts = []
    for e in errors[:5]:
        loc = [str(p) for p in e.get("loc", ()) if p not in ("body", "query", "path")]
        message = str(e.get("msg", "invalid"))
        # A check of ours raised in a validator: pydantic's "Value error, " says nothing.
        message = message.removeprefix("Value error, ")
        if e.get("type") == "recursion_loop" or message.startswith("Recursion error"):
            # Its location is the whole nesting (hundreds of steps): the field is enough.
            loc, message = loc[:1], "nested too deeply (a JSON value of at most about 250 levels)"
        elif e.get("type") == "string_pattern_mismatch" and loc[-1:] == ["idempotency-key"]:
            message = "must be 1-255 visible ASCII characters (no space, no control character)"
        where = ".".join(loc)
        if len(where) > 80:
            where = where[:77] + "..."
        if not where and e.get("type") == "missing":
            parts.append("the request needs a JSON body")
            continue
        if not where and e.get("type") == "value_error":
            parts.append(message)  # a check of the whole body: it names its fields
            continue
        parts.append(f"{where or 'body'}: {message}")
    return 422, "validation_error", "; ".join(parts) or "the request is not valid"


# SQLSTATEs a request's own value causes: invalid text for the type (22P02), a NUL in JSON
# (22P05), a number out of range (22003), a character the encoding lacks (22021).
_REQUEST_STATES = ("22P02", "22P05", "22003", "22021")


def _caused_by_request(exc: Exception) -> bool:
    """A value of the request the database cannot store: psycopg's refusal of a NUL in text
    (no SQLSTATE), an unpaired surrogate, or one of :data:`_REQUEST_STATES`. Anything else
    of class 22 is a fault of ours, answered 500."""
    if isinstance(exc, UnicodeEncodeError):
        return exc.reason == "surrogates not allowed"
    return getattr(exc, "sqlstate", None) in _REQUEST_STATES or _is_nul(exc)


def _is_nul(exc: Exception) -> bool:
    """psycopg's refusal of a NUL in text (it has no SQLSTATE: it never reaches the server)."""
    return not isinstance(exc, UnicodeEncodeError) and (
        getattr(exc, "sqlstate", None) is None and "NUL" in str(exc)
    )


def _unstorable(exc: Exception) -> str:
    """What is wrong with a request value the database refused (SQLSTATE class 22) or that
    cannot be encoded for it, without echoing the value (nor the database's context,
    which quotes it)."""
    surrogate = "a text value is not valid Unicode (it holds an unpaired surrogate)"
    if isinstance(exc, UnicodeEncodeError):
        return surrogate
    sqlstate = getattr(exc, "sqlstate", None)
    diag = getattr(exc, "diag", None)
    if sqlstate == "22P02" and "surrogate" in str(getattr(diag, "message_detail", "") or ""):
        return surrogate  # in JSON, escaped
    if sqlstate is None and "NUL" in str(exc):
        return "a text value contains a NUL character (\\u0000), which cannot be stored"
    if sqlstate == "22P05":
        return "the payload contains a NUL character (\\u0000), which PostgreSQL's JSON cannot hold"
    if sqlstate == "22P02" and "json" in str(exc):
        return (
            "the payload is not JSON PostgreSQL accepts (NaN, Infinity and numbers past a"
            " double's range, such as 1e999, are not JSON numbers it can store)"
        )
    if sqlstate == "22003":
        return "a number in the request is out of range"
    return f"a value in the request cannot be stored (SQLSTATE {sqlstate or 'none'})"


def _with_nul(values: Mapping[str, Any]) -> list[str]:
    return sorted(k for k, v in values.items() if isinstance(v, str) and "\x00" in v)


def _nul_in_request(request: Request) -> tuple[int, str, str] | None:
    """A NUL the database refused that came in the path or the query string: an id in the
    path names nothing that could exist (404, as any unknown id); a filter is a filter
    that cannot match (422 naming it). None: it came in the body, as before."""
    if _with_nul(request.path_params):
        return 404, "not_found", "no such resource (an id with a NUL character)"
    names = _with_nul(dict(request.query_params))
    if names:
        shown = ", ".join(n[:40].replace("\x00", "\\u0000") for n in names[:5])
        return (
            422,
            "validation_error",
            f"{shown}: a filter cannot contain a NUL character (\\u0000)",
        )
    return None


# How to narrow each read the statement timeout can stop (by the path under /api/v1).
_NARROWING = (
    ("/deliveries", "a filter such as endpoint_id, status, stream_id, event_type or tenant"),
    ("/events", "a filter such as stream_id, event_type or tenant"),
    ("/stats", "a shorter window, a smaller endpoints_limit or a tenant"),
)


def _too_long_message(request: Request) -> str:
    """What a read stopped by the statement timeout is told: how long a read may take and
    how to ask for less (never the query itself)."""
    from .app import API_PREFIX as API_V1
    from .app import READ_STATEMENT_TIMEOUT_MS

    path = request.url.path.removeprefix(API_V1)
    how = next((h for prefix, h in _NARROWING if path.startswith(prefix)), "a filter")
    seconds = f"{READ_STATEMENT_TIMEOUT_MS / 1000:g}"
    return f"the query took longer than {seconds} s and was stopped; narrow it with {how}"


class _AggregatedWarnings:
    """Warnings of one kind (a reason) said once, then at most once per
    :data:`UNAVAILABLE_LOG_EVERY_S` (read at each call): the ones within that time are
    counted and said as a count at its end (the next time starts then), or by the next
    line when the time was shortened meanwhile."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}  # reason -> when its last line was written
        self._quiet: dict[str, tuple[int, str]] = {}  # reason -> (not said, the last of them)
        self._timers: dict[str, asyncio.TimerHandle] = {}

    def warn(self, reason: str, line: str) -> None:
        every = UNAVAILABLE_LOG_EVERY_S
        now = time.monotonic()
        last = self._last.get(reason)
        if last is not None and now - last < every:
            count, _ = self._quiet.get(reason, (0, line))
            self._quiet[reason] = (count + 1, line)
            if reason not in self._timers:
                loop = asyncio.get_running_loop()
                self._timers[reason] = loop.call_later(last + every - now, self._flush, reason)
            return
        count, _ = self._take(reason)
        self._last[reason] = now
        if count:
            log.warning("%s (and %d more since the last such line)", line, count)
        else:
            log.warning("%s", line)

    def _take(self, reason: str) -> tuple[int, str]:
        timer = self._timers.pop(reason, None)
        if timer is not None:
            timer.cancel()
        return self._quiet.pop(reason, (0, ""))

    def _flush(self, reason: str) -> None:
        count, line = self._take(reason)
        if count:
            self._last[reason] = time.monotonic()
            log.warning("%d more answered 503 since the last such line (the last: %s)", count, line)


def install(app: FastAPI, html_error: Any) -> None:
    """Register the handlers; ``html_error(request, status, message)`` renders the
    dashboard's error page."""

    def answer(
        request: Request,
        status: int,
        code: str,
        message: str,
        headers: Mapping[str, str] | None = None,
    ) -> Response:
        if request.url.path.startswith(API_PREFIX):
            return error_response(status, code, message, headers)
        result: Response = html_error(request, status, message)
        result.headers.update(headers or {})
        return result

    @app.exception_handler(ApiError)
    async def _ours(request: Request, exc: ApiError) -> Response:
        if exc.status == 401:
            # A failed authentication waits its turn (deps.FAILED_AUTH_PER_S), holding no
            # database connection: the route's was given back before this handler ran.
            state = getattr(request.app.state, "fluxora", None)
            if state is not None:
                await state.failures.wait()
        return answer(request, exc.status, exc.code, exc.message)

    @app.exception_handler(NotFoundError)
    async def _not_found(request: Request, exc: NotFoundError) -> Response:
        return answer(request, 404, "not_found", str(exc))

    @app.exception_handler(ConflictError)
    async def _conflict(request: Request, exc: ConflictError) -> Response:
        return answer(request, 409, "conflict", str(exc))

    @app.exception_handler(EndpointLimitReached)
    async def _limit(request: Request, exc: EndpointLimitReached) -> Response:
        return answer(request, 409, "endpoint_limit", str(exc))

    @app.exception_handler(IdempotencyKeyReused)
    async def _key_reused(request: Request, exc: IdempotencyKeyReused) -> Response:
        return answer(request, 422, "idempotency_key_reused", str(exc))

    @app.exception_handler(ConfigError)
    async def _invalid(request: Request, exc: ConfigError) -> Response:
        return answer(request, 422, "validation_error", str(exc))

    @app.exception_handler(EndpointError)
    async def _refused(request: Request, exc: EndpointError) -> Response:
        return answer(request, 422, "validation_error", str(exc))

    @app.exception_handler(psycopg.errors.QueryCanceled)
    async def _too_long(request: Request, exc: psycopg.errors.QueryCanceled) -> Response:
        # A read stopped by its statement timeout (api/app.py): the same request would be
        # stopped again, so it is not answered 503 (which clients retry, each retry holding
        # a connection for as long again) but 422, saying how to ask for less. An
        # operator's pg_cancel_backend is the database's business: 503. The two share a
        # SQLSTATE, and the server's words are in its language (lc_messages): the rare one
        # is told by its English words, and a read cancelled in other words is the
        # timeout (it was a 503 beside a server that speaks German).
        reason = str(getattr(exc.diag, "message_primary", "") or "")
        if "user request" in reason or request.method not in ("GET", "HEAD"):
            return await _database_unavailable(request, exc)
        log.warning(
            "%s %s: answered 422, the query ran past the statement timeout",
            request.method,
            request.url.path,
        )
        return answer(request, 422, "query_timeout", _too_long_message(request))

    unavailable = _AggregatedWarnings()

    @app.exception_handler(psycopg.OperationalError)
    @app.exception_handler(psycopg.InterfaceError)
    @app.exception_handler(PoolTimeout)
    @app.exception_handler(psycopg.errors.ReadOnlySqlTransaction)
    async def _database_unavailable(request: Request, exc: Exception) -> Response:
        # A restart, a failover, a lock or statement timeout, a pool with no connection
        # free: nothing a client did wrong, and over when the database is back.
        if isinstance(exc, psycopg.errors.ReadOnlySqlTransaction):
            message = f"the database is read-only (a standby?): {READ_ONLY_HINT}"
        else:
            message = f"the database is not available ({type(exc).__name__}); try again"
        unavailable.warn(message, f"{request.method} {request.url.path}: answered 503, {message}")
        response = answer(request, 503, "unavailable", message)
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response

    @app.exception_handler(psycopg.errors.InsufficientPrivilege)
    async def _not_granted(request: Request, exc: Exception) -> Response:
        # The API's database role lacks a privilege (a role that may only read, asked to
        # write): the operator's to grant, said without a traceback. PostgreSQL's words
        # name the table and hold no data.
        said = str(getattr(getattr(exc, "diag", None), "message_primary", "") or "")[:200]
        message = (
            f"the API's database role may not do this ({said or 'permission denied'}): grant"
            ' it the privileges of docs/operations.md, "Roles and privileges"'
        )
        log.error("%s %s: answered 500, %s", request.method, request.url.path, message)
        return answer(request, 500, "database_privilege", message)

    @app.exception_handler(psycopg.DataError)
    @app.exception_handler(UnicodeEncodeError)
    async def _unstorable_value(request: Request, exc: Exception) -> Response:
        if not _caused_by_request(exc):
            raise exc  # answered 500 and logged (app.Guard)
        nul = _nul_in_request(request) if _is_nul(exc) else None
        status, code, message = nul or (422, "validation_error", _unstorable(exc))
        log.warning("%s %s: refused, %s", request.method, request.url.path, message)
        return answer(request, status, code, message)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        content_type = request.headers.get("content-type", "")
        return answer(request, *_validation_message(exc, content_type))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        code = _CODES.get(exc.status_code, "error")
        message = exc.detail if isinstance(exc.detail, str) else code.replace("_", " ")
        if exc.status_code == 404:
            message = "no such resource"
        elif exc.status_code == 400 and message == _PARSE_FAILED:
            # FastAPI's answer when reading the JSON raised anything but a decoding error:
            # a body that is not UTF-8, or nested deeper than Python's JSON reader goes.
            message = await _unreadable_body(request)
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            headers["Allow"] = _allowed(request)
        return answer(request, exc.status_code, code, message, headers)


# FastAPI's 400 when its JSON reader fails on a body for another reason than bad JSON.
_PARSE_FAILED = "There was an error parsing the body"


async def _unreadable_body(request: Request) -> str:
    """Why FastAPI could not read the body (it keeps the body it read)."""
    try:
        (await request.body()).decode("utf-8")
    except UnicodeDecodeError:
        return "the request body is not valid JSON: it is not UTF-8 text"
    except Exception:  # the body is gone: say both
        return "the request body cannot be read as JSON (not UTF-8, or nested too deeply)"
    return "the request body cannot be read: JSON nested too deeply"


def _allowed(request: Request) -> str:
    """A 405's Allow (RFC 9110 requires it): the methods any route of the path takes (the
    router names only the first route's, and each method is a route of its own here),
    asked of the routes themselves, with HEAD wherever GET is (app.Guard answers it). A
    mount (the static files) takes GET and HEAD only."""
    methods = set()
    routes = [r for r in request.app.router.routes if not isinstance(r, Mount)]
    for method in _METHODS:
        scope = {**request.scope, "method": method}
        if any(route.matches(scope)[0] is Match.FULL for route in routes):
            methods.add(method)
    if not methods or "GET" in methods:
        methods |= {"GET", "HEAD"}
    return ", ".join(sorted(methods))
