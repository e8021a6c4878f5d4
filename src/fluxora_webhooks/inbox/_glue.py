"""What the framework glue shares: one delivery, from raw request to (status, JSON body).

The answers are chosen for the sender's retry rules (SPEC 4): 2xx stops the retries (the
event is applied, now or before), 401 and 400 dead-letter at once (a retry would fail the
same way), 5xx asks for a retry (the transaction rolled back: nothing happened).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, TypeAlias

import psycopg
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from ..errors import SchemaError, VerificationError
from ..logs import scrub
from ..signing import DEFAULT_TOLERANCE_SECONDS
from . import Headers, InboxEvent, TransactionAborted, _verified_event, check_committable, receive

log = logging.getLogger("fluxora_webhooks.inbox")

#: Where the glue takes its connection from: a psycopg async pool, or any callable that
#: returns an async context manager yielding an ``AsyncConnection`` (``pool.connection``,
#: or your own).
ConnectionSource: TypeAlias = (
    AsyncConnectionPool[Any]
    | Callable[[], AbstractAsyncContextManager[psycopg.AsyncConnection[Any]]]
)
# The reasons that a signed request can carry: refusing it for good is right (400).
_MALFORMED = frozenset({"bad_payload", "bad_delivery_id"})
# How long a request waits for a connection and for its id (another copy of the delivery
# may hold it uncommitted: a consumer process paused mid-request holds it until its
# session ends) before it is answered 503. Below the sender's 15 s timeout: a request
# still waiting when the sender has given up would hold a pool connection for nothing,
# and a few such requests would hold them all.
RECEIVE_WAIT_S = 10.0


@dataclass(frozen=True, slots=True)
class Verification:
    """How the glue verifies: the arguments of :func:`fluxora_webhooks.inbox.receive`."""

    secret: str | bytes
    previous_secret: str | bytes | None = None
    tolerance_s: int = DEFAULT_TOLERANCE_SECONDS
    scheme: str = "auto"

    def __post_init__(self) -> None:
        # A mistake in the set-up (empty secret, bad scheme) fails when the app is built,
        # not on every request: the arguments are checked before any header is read.
        # No headers: VerificationError, as expected, once the arguments were accepted.
        with contextlib.suppress(VerificationError):
            self.check(b"", {})

    def check(self, body: bytes, headers: Headers) -> InboxEvent:
        """Verify and parse without a database (what receive checks before it records)."""
        return _verified_event(
            body,
            headers,
            self.secret,
            previous=self.previous_secret,
            tolerance=self.tolerance_s,
            now=None,
            scheme=self.scheme,
        )


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: dict[str, str]


def check_handler(handler: object) -> None:
    """A handler that is not callable fails when the app is built, not on every request."""
    if not callable(handler):
        raise TypeError(
            "handler must be an async function (event, conn, request), "
            f"not {type(handler).__name__}"
        )


def connector(
    source: ConnectionSource,
) -> Callable[[], AbstractAsyncContextManager[psycopg.AsyncConnection[Any]]]:
    if isinstance(source, AsyncConnectionPool):
        return source.connection
    if not callable(source):
        raise TypeError("connection must be an AsyncConnectionPool or a callable")
    return source


async def deliver(
    connect: Callable[[], AbstractAsyncContextManager[psycopg.AsyncConnection[Any]]],
    verification: Verification,
    apply: Callable[[InboxEvent, psycopg.AsyncConnection[Any]], Awaitable[object]],
    *,
    body: bytes,
    headers: Headers,
) -> Answer:
    """Verify, then in one transaction: receive, apply (first time only), commit."""
    try:
        # First without a connection: forged traffic never takes one from the pool.
        checked = verification.check(body, headers)
    except VerificationError as exc:
        return _refused(exc)
    delivery_id = checked.delivery_id
    try:
        async with asyncio.timeout(RECEIVE_WAIT_S) as waiting:
            async with connect() as conn, conn.transaction():
                _check_deadline(waiting)
                event = await receive(
                    conn,
                    body=body,
                    headers=headers,
                    secret=verification.secret,
                    previous_secret=verification.previous_secret,
                    tolerance_s=verification.tolerance_s,
                    scheme=verification.scheme,
                )
                _check_deadline(waiting)
                waiting.reschedule(None)  # the handler takes the time it takes
                if event is not None:
                    try:
                        await apply(event, conn)
                        await check_committable(conn)
                    except Exception as exc:
                        if _transient(exc, conn):
                            raise  # the database's doing, not the handler's: 503 below
                        raise _HandlerFailed from exc
    except _HandlerFailed as failed:
        cause = failed.__cause__
        if isinstance(cause, TransactionAborted):
            log.warning("webhook %s not applied, the sender will retry: %s", delivery_id, cause)
        elif isinstance(cause, psycopg.Rollback):
            # Caught here, psycopg.Rollback would end the transaction quietly: the id
            # would not be recorded, yet the sender would get a 2xx and stop.
            log.warning(
                "the handler of webhook %s raised psycopg.Rollback: nothing was applied, "
                "the sender will retry (return without writing to skip an event)",
                delivery_id,
            )
        else:
            log.error(
                "handling webhook %s failed; rolled back, the sender will retry",
                delivery_id,
                exc_info=cause,
            )
        return Answer(500, {"error": "handler_failed"})
    except VerificationError as exc:  # the clock moved past the tolerance in between
        return _refused(exc)
    except SchemaError as exc:
        log.error("webhook %s not received: %s", delivery_id, exc)
        return Answer(500, {"error": "inbox_not_installed"})
    except TimeoutError:
        # Cancelled in the server too (psycopg cancels a query its task leaves).
        log.warning(
            "webhook %s not received: no connection, or another copy of it still"
            " uncommitted, within %g s; the sender will retry",
            delivery_id,
            RECEIVE_WAIT_S,
        )
        return Answer(503, {"error": "database_unavailable"})
    except (psycopg.OperationalError, PoolTimeout) as exc:
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        log.warning(
            "webhook %s not received: database unavailable (%s)", delivery_id, scrub(first_line)
        )
        return Answer(503, {"error": "database_unavailable"})
    except Exception:
        log.exception("webhook %s failed; rolled back, the sender will retry", delivery_id)
        return Answer(500, {"error": "handler_failed"})
    status = "processed" if event is not None else "duplicate"
    return Answer(200, {"status": status, "delivery_id": delivery_id})


def _check_deadline(waiting: asyncio.Timeout) -> None:
    """The wait's end, even when its cancellation was lost: Python 3.11's
    ``asyncio.wait_for`` (psycopg_pool's queue uses it) returns the connection handed over
    at the moment the wait is cancelled, and drops the cancellation. The receive would then
    wait without a deadline behind a copy held uncommitted, holding a pool connection and
    the sender's request for as long."""
    if waiting.expired():
        raise TimeoutError


class _HandlerFailed(Exception):
    """The handler raised (its exception is the cause): 500 ``handler_failed``."""


def _transient(exc: Exception, conn: psycopg.AsyncConnection[Any]) -> bool:
    """Whether the handler's exception is the database's passing state rather than the
    handler's fault: its connection lost, or its transaction chosen to end (a deadlock, a
    serialization failure). Anything else it raises, a lock timeout or a cancelled
    statement included, is the handler's failure."""
    if isinstance(exc, psycopg.errors.SerializationFailure | psycopg.errors.DeadlockDetected):
        return True
    return isinstance(exc, psycopg.OperationalError) and conn.broken


def _refused(exc: VerificationError) -> Answer:
    log.info("webhook refused: %s (%s)", exc.reason, exc)
    error = "bad_request" if exc.reason in _MALFORMED else "verification_failed"
    return Answer(400 if exc.reason in _MALFORMED else 401, {"error": error, "reason": exc.reason})
