"""The outbox: enqueue (producer side) and the dispatcher's claim and completion queries.

Rows are of two kinds. An *event row* is what a producer writes (``endpoint_id`` NULL);
the dispatcher that claims it routes it in the same transaction (:func:`route_events`,
before the batch's requests, which take up to a batch of its due deliveries along): one
delivery row per matching endpoint of its tenant, and the event row itself
becomes the delivery of the built-in ``default`` endpoint, or is marked ``routed`` /
``unrouted`` where there is none. A *delivery row* is one attempt of one delivery (an
endpoint, a delivery id); a retry is a new delivery row due later, as before.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
import weakref
from collections.abc import Awaitable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from functools import cache
from typing import Any, overload

import psycopg
from psycopg.rows import tuple_row
from psycopg.types.json import Jsonb

from . import pgarray
from .errors import SchemaError
from .queries import native, query

log = logging.getLogger(__name__)

NOTIFY_CHANNEL = "webhook_outbox"
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
ENDPOINTS_CHANNEL = "webhook_endpoints"


class Outcome(StrEnum):
    """What an attempt (or a decision not to attempt) did to a claimed row.

    ``delivered``, ``retry`` and ``dead_letter`` are recorded on the row
    (``webhook_outbox.outcome``), as are ``routed`` / ``unrouted`` for an event row with no
    default endpoint to deliver it itself. ``deferred``, ``parked`` and ``leased`` consume no
    attempt: a deferral moves the due time, a parked row waits for its endpoint to be
    enabled, a leased row's request outlived its batch and is recorded when it ends.
    """

    DELIVERED = "delivered"
    RETRY = "retry"
    DEAD_LETTER = "dead_letter"
    DEFERRED = "deferred"
    PARKED = "parked"
    LEASED = "leased"
    ROUTED = "routed"
    UNROUTED = "unrouted"  # counted only: an event row recorded with no endpoint to go to


# A tenant's name (SPEC 10): '' is the default tenant. The API, the CLI and enqueue() all
# refuse any other: an event for "acme corp" would be recorded as unrouted, reaching no one.
TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}", re.ASCII)
# The limits of an event, the API's (POST /api/v1/events) and enqueue's alike: the event
# type is sent as a header as it is; the stream id is a key of the outbox's indexes (an
# ordered endpoint's among them, whose entries PostgreSQL bounds at about 2,700 bytes: 500
# characters are at most 2,000 bytes); the payload, as JSON, is the request body each
# consumer receives, and the consumers' inbox glue refuses a body over 1 MiB.
# Not starting or ending with a space: a header's value loses those (RFC 9110 5.5), so the
# consumer would read another type than the one the endpoints' filters were matched with.
MAX_EVENT_TYPE = 200
EVENT_TYPE = re.compile(rf"[!-~](?:[ -~]{{0,{MAX_EVENT_TYPE - 2}}}[!-~])?", re.ASCII)
MAX_STREAM_ID = 500
MAX_PAYLOAD_BYTES = 1 << 20
# How deep a payload may nest (an array or object counts one level): the API's refusal of
# a deeper request body ("about 250 levels") and what its answers can serialize; one
# stored deeper (by SQL) is shown without its payload (:func:`payload_too_deep`).
MAX_PAYLOAD_DEPTH = 250
# A NUL escaped in JSON text (after an even number of backslashes, which are escapes of
# their own): PostgreSQL's jsonb cannot hold one.
_JSON_NUL = re.compile(rb"(?<!\\)(?:\\\\)*\\u0000")


def _check_names(tenant: str, stream_id: str, event_type: str) -> None:
    if not isinstance(tenant, str) or (tenant and not TENANT.fullmatch(tenant)):
        raise ValueError(
            "tenant must be empty (the default tenant) or 1-128 letters, digits and ._:@-"
        )
    if not isinstance(stream_id, str) or not 1 <= len(stream_id) <= MAX_STREAM_ID:
        shown = f" (is {len(stream_id)})" if isinstance(stream_id, str) else ""
        raise ValueError(f"stream_id must be a string of 1 to {MAX_STREAM_ID} characters{shown}")
    if "\x00" in stream_id or not _storable(stream_id):
        raise ValueError(
            "stream_id must be text PostgreSQL can store: no NUL character (\\u0000) and no"
            " unpaired surrogate"
        )
    if not isinstance(event_type, str) or not EVENT_TYPE.fullmatch(event_type):
        long = isinstance(event_type, str) and len(event_type) > MAX_EVENT_TYPE
        shown = f" (is {len(event_type)} characters)" if long else ""
        raise ValueError(
            f"event_type must be 1 to {MAX_EVENT_TYPE} printable ASCII characters, not starting"
            f" or ending with a space (it is sent as a header){shown}"
        )


def _storable(text: str) -> bool:
    """Whether ``text`` encodes to UTF-8 (strictly: a lone surrogate does not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# What Python's JSON reads as a float PostgreSQL's jsonb cannot take: NaN, Infinity, and a
# literal past a double's range, which Python reads as infinity (1e999 sent to the API).
_NOT_A_JSON_NUMBER = (
    "NaN, Infinity and numbers past a double's range (such as 1e999) are not JSON numbers"
    " it can store"
)


_CONTAINERS = (dict, list, tuple)
# A number Python's JSON writes with an exponent (1e+308, 1.5e-07): only then can jsonb's
# text be longer than Python's (a text value matching it costs one needless look).
_EXPONENT = re.compile(rb"[0-9]e[-+]")


def _nested_deeper(payload: Any, limit: int) -> bool:
    """Whether arrays and objects nest deeper than ``limit`` (one level each); no
    recursion."""
    stack: list[tuple[Any, int]] = [(payload, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            return True
        items = value.values() if isinstance(value, dict) else value
        stack.extend((item, depth + 1) for item in items if isinstance(item, _CONTAINERS))
    return False


def _expansion(payload: Any) -> int:
    """The bytes jsonb's text adds to Python's JSON: jsonb writes a number with no exponent,
    so a float Python writes as ``1e+308`` is 309 digits as stored and sent."""
    extra = 0
    stack = [payload]
    while stack:
        value = stack.pop()
        if isinstance(value, float):
            extra += _expanded(value)
        elif isinstance(value, _CONTAINERS):
            stack.extend(value.values() if isinstance(value, dict) else value)
    return extra


def _expanded(number: float) -> int:
    """How much longer jsonb writes a float than Python's JSON does (0 without exponent).
    ``float.__repr__``: what json.dumps writes for a float subclass too (numpy's)."""
    if number == 0 or 1e-4 <= abs(number) < 1e16:
        return 0  # written without exponent by both
    text = float.__repr__(number)
    if "e" not in text:
        return 0
    from decimal import Decimal

    return max(0, len(format(Decimal(text), "f")) - len(text))


def payload_too_deep(payload: Any) -> bool:
    """Whether a stored payload nests deeper than :data:`MAX_PAYLOAD_DEPTH` (SQL producers
    are not checked by :func:`enqueue`): the API shows such an event without it."""
    return isinstance(payload, _CONTAINERS) and _nested_deeper(payload, MAX_PAYLOAD_DEPTH)


def _too_large(size: int) -> ValueError:
    return ValueError(
        f"payload must be at most {MAX_PAYLOAD_BYTES} bytes (1 MiB) as JSON as it is stored"
        f" and sent (jsonb's text: ', ' and ': ' between items, numbers with no exponent;"
        f" is {size})"
    )


_TOO_DEEP = (
    f"payload is nested too deeply: at most {MAX_PAYLOAD_DEPTH} levels of arrays and objects"
    " (as the API takes)"
)


def payload_json(payload: Any) -> bytes:
    """``payload`` as the JSON PostgreSQL is sent (UTF-8, as its jsonb text prints it), or a
    ``ValueError`` naming what it cannot hold; before anything reaches the database, where
    the same value would abort the caller's transaction. The walks over the value (its
    depth, its floats' length as stored) run only when the JSON text says they may
    matter: more brackets than the depth allowed, a number with an exponent."""
    try:
        text = json.dumps(payload, ensure_ascii=False, allow_nan=False)
    except RecursionError:
        raise ValueError(_TOO_DEEP) from None
    except ValueError as exc:  # NaN or Infinity, or a circular reference
        why = _NOT_A_JSON_NUMBER if "float" in str(exc) else str(exc)
        raise ValueError(f"payload cannot be stored as JSON: {why}") from None
    except TypeError as exc:
        raise TypeError(f"payload must be JSON-serializable: {exc}") from None
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(
            "payload holds an unpaired surrogate: it is not valid Unicode text"
        ) from None
    if len(data) > MAX_PAYLOAD_BYTES:
        raise _too_large(len(data))
    brackets = data.count(b"[") + data.count(b"{")
    if brackets > MAX_PAYLOAD_DEPTH and _nested_deeper(payload, MAX_PAYLOAD_DEPTH):
        raise ValueError(_TOO_DEEP)
    if _EXPONENT.search(data):
        size = len(data) + _expansion(payload)
        if size > MAX_PAYLOAD_BYTES:
            raise _too_large(size)
    if b"\\u0000" in data and _JSON_NUL.search(data):
        raise ValueError(
            "payload contains a NUL character (\\u0000), which PostgreSQL's JSON cannot hold"
        )
    return data


@overload
def enqueue(
    conn: psycopg.Connection[Any] | psycopg.Cursor[Any],
    *,
    stream_id: str,
    event_type: str,
    payload: Any,
    tenant: str = "",
) -> str: ...


@overload
def enqueue(
    conn: psycopg.AsyncConnection[Any] | psycopg.AsyncCursor[Any],
    *,
    stream_id: str,
    event_type: str,
    payload: Any,
    tenant: str = "",
) -> Awaitable[str]: ...


def enqueue(
    conn: psycopg.Connection[Any]
    | psycopg.AsyncConnection[Any]
    | psycopg.Cursor[Any]
    | psycopg.AsyncCursor[Any],
    *,
    stream_id: str,
    event_type: str,
    payload: Any,
    tenant: str = "",
) -> str | Awaitable[str]:
    """Write one event into the outbox on the caller's connection, in the caller's
    transaction, and return its delivery id (the default endpoint's; every endpoint the
    event fans out to gets a delivery id of its own when it is routed).

    Nothing is sent unless that transaction commits. With an async connection, await it::

        with conn.transaction():
            conn.execute("UPDATE streams ...")
            enqueue(conn, stream_id="s1", event_type="stream.updated", payload={...})

    ``conn`` is a psycopg 3 connection or cursor, sync or async (whatever its row factory).
    ``tenant`` is the customer the event belongs to ('' is the default tenant): it reaches
    that tenant's endpoints only. ``payload`` is a Python value, stored as JSON.

    Refused before anything reaches the database: a connection of another driver
    (``TypeError``), a payload that is not JSON-serializable (``TypeError``), and with a
    ``ValueError`` naming the field: an invalid tenant, a stream id not of 1 to 500
    characters, an event type not of 1 to 200 printable ASCII characters (or starting or
    ending with a space, which the header it is sent in would drop), a payload over
    1 MiB as JSON as stored and sent (jsonb's text) or nested deeper than 250 levels, with
    NaN or Infinity, a NUL character or an unpaired surrogate in text.
    A database whose schema is older than the code raises :class:`SchemaError`.
    """
    target = _connection(conn)
    params = _enqueue_params(target, tenant, stream_id, event_type, payload, _trace_context())
    if isinstance(target, psycopg.AsyncConnection):
        return _enqueue_async(target, params)
    # A cursor of its own: the caller's row factory (dict_row, a class) may not index by
    # position, and a failure after the INSERT ran would invite a retry that enqueues twice.
    with _own_cursor(target) as cur:
        try:
            row = cur.execute(query("enqueue"), params).fetchone()
        except _SCHEMA_FAULTS as exc:
            raise _schema_error(exc) from exc
    assert row is not None
    return _id_text(row[0])


def _own_cursor(conn: psycopg.Connection[Any]) -> psycopg.Cursor[Any]:
    """A cursor of tuples that binds as psycopg does by default, whatever the connection's
    cursor factory (a raw cursor takes $1 placeholders, not the statement's named ones)."""
    if issubclass(conn.cursor_factory, psycopg.RawCursor):
        return psycopg.Cursor(conn, row_factory=tuple_row)
    return conn.cursor(row_factory=tuple_row)


def _own_async_cursor(conn: psycopg.AsyncConnection[Any]) -> psycopg.AsyncCursor[Any]:
    """:func:`_own_cursor` of an async connection."""
    if issubclass(conn.cursor_factory, psycopg.AsyncRawCursor):
        return psycopg.AsyncCursor(conn, row_factory=tuple_row)
    return conn.cursor(row_factory=tuple_row)


def _id_text(value: Any) -> str:
    """The id as text: a SQL_ASCII connection reads text as bytes (it was returned as
    ``"b'...'"``)."""
    return value.decode("ascii") if isinstance(value, bytes) else str(value)


async def enqueue_with_context(
    conn: psycopg.AsyncConnection[Any],
    *,
    stream_id: str,
    event_type: str,
    payload: Any,
    tenant: str = "",
    traceparent: str | None,
    tracestate: str | None = None,
) -> str:
    """:func:`enqueue` with a trace context given rather than the current span's: an HTTP
    producer's ``traceparent`` (and ``tracestate``) request headers, for one. Each is
    kept when it is a valid W3C value and dropped otherwise (a tracestate without a
    valid traceparent too); with none valid, the current span's context, as enqueue."""
    from .tracing import traceparent_header, tracestate_header

    target = _connection(conn)
    if not isinstance(target, psycopg.AsyncConnection):
        raise TypeError("enqueue_with_context takes a psycopg AsyncConnection (await it)")
    parent = traceparent_header(traceparent)
    context = (
        {"traceparent": parent, "tracestate": tracestate_header(tracestate)}
        if parent is not None
        else _trace_context()
    )
    return await _enqueue_async(
        target, _enqueue_params(target, tenant, stream_id, event_type, payload, context)
    )


# Hints for the connections of other libraries enqueue is handed most often, by the top
# package of the object's type (none of them is imported to ask).
_OTHER_DRIVERS = {
    "django": "with Django, pass django.db.connection.connection inside"
    " transaction.atomic(): the psycopg connection the atomic block's transaction runs on",
    "asyncpg": "enqueue cannot run on asyncpg: use a psycopg AsyncConnection, or the plain"
    " SQL INSERT INTO webhook_outbox in your transaction (examples/README.md)",
    "sqlalchemy": "with SQLAlchemy (postgresql+psycopg), pass"
    " session.connection().connection.driver_connection; with its asyncio extension,"
    " (await (await session.connection()).get_raw_connection()).driver_connection",
    "psycopg2": "psycopg2 is not supported: use psycopg 3, or the plain SQL INSERT INTO"
    " webhook_outbox in your transaction",
    "psycopg_pool": "take a connection from the pool: with pool.connection() as conn",
}


def _connection(
    conn: object,
) -> psycopg.Connection[Any] | psycopg.AsyncConnection[Any]:
    """The psycopg connection ``conn`` is or belongs to; a ``TypeError`` naming what was
    passed otherwise (an asyncpg connection would fail only after a coroutine was made)."""
    if isinstance(conn, psycopg.Connection | psycopg.AsyncConnection):
        return conn
    if isinstance(conn, psycopg.Cursor | psycopg.AsyncCursor):
        return conn.connection
    kind = type(conn)
    name = f"{kind.__module__}.{kind.__qualname__}"
    hint = _OTHER_DRIVERS.get(kind.__module__.split(".")[0])
    raise TypeError(
        "enqueue takes a psycopg 3 connection or cursor (psycopg.Connection, AsyncConnection,"
        f" Cursor or AsyncCursor), not {name}" + (f"; {hint}" if hint else "")
    )


# What enqueue meets on a database older than the code: a column (tenant, traceparent...)
# or the table itself missing. Told from the error, not asked per call (the hot path).
_SCHEMA_FAULTS = (psycopg.errors.UndefinedColumn, psycopg.errors.UndefinedTable)


def _schema_error(exc: psycopg.Error) -> SchemaError:
    what = exc.diag.message_primary or type(exc).__name__
    return SchemaError(
        f"the outbox's schema is missing or older than this version of fluxora-webhooks"
        f" ({what}): run `fluxora-webhooks migrate`"
    )


def _enqueue_params(
    conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any],
    tenant: str,
    stream_id: str,
    event_type: str,
    payload: Any,
    context: dict[str, str | None],
) -> dict[str, Any]:
    """The enqueue statement's parameters, every value checked first."""
    _check_names(tenant, stream_id, event_type)
    data = payload_json(payload)
    encoding = conn.info.encoding
    if encoding != "utf-8":
        data = _in_client_encoding(payload, stream_id, encoding, conn)
    return {
        "tenant": tenant,
        "stream_id": stream_id,
        "event_type": event_type,
        "payload": Jsonb(payload, dumps=lambda _: data),  # serialized once, above
        **context,
    }


def _in_client_encoding(
    payload: Any,
    stream_id: str,
    encoding: str,
    conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any],
) -> bytes:
    """The payload's JSON for a connection whose client_encoding is not UTF8 (a DBA's
    ``ALTER DATABASE|ROLE ... SET client_encoding``, ``PGCLIENTENCODING``): every character
    past ASCII written as a JSON escape, which any client encoding carries and the database
    stores as the character itself (sent as UTF-8, the server read its bytes in that
    encoding and stored mojibake, without an error). A stream id the encoding cannot carry
    is refused, naming it (psycopg's UnicodeEncodeError did not)."""
    try:
        stream_id.encode(encoding)
    except UnicodeEncodeError:
        name = conn.info.parameter_status("client_encoding") or encoding
        raise ValueError(
            f"stream_id holds characters the connection's client_encoding ({name}) cannot"
            " carry: connect with client_encoding=UTF8 (a connection parameter)"
        ) from None
    return json.dumps(payload, ensure_ascii=True, allow_nan=False).encode("ascii")


def _trace_context() -> dict[str, str | None]:
    """The caller's W3C trace context, when the OpenTelemetry extra is installed and a span
    is current (see :mod:`fluxora_webhooks.tracing`)."""
    from .tracing import current_context

    traceparent, tracestate = current_context()
    return {"traceparent": traceparent, "tracestate": tracestate}


async def _enqueue_async(conn: psycopg.AsyncConnection[Any], params: dict[str, Any]) -> str:
    async with _own_async_cursor(conn) as cur:
        try:
            await cur.execute(query("enqueue"), params)
        except _SCHEMA_FAULTS as exc:
            raise _schema_error(exc) from exc
        row = await cur.fetchone()
    assert row is not None
    return _id_text(row[0])


@dataclass(frozen=True, slots=True)
class Claimed:
    """A claimed outbox row, ready to route and send."""

    id: int
    delivery_id: str
    event_type: str
    body: bytes
    attempt: int
    replay: bool = False
    # Unix seconds on the database's clock at the claim: the signed x-fluxora-timestamp
    # and webhook-timestamp (a dispatcher whose clock is off must not sign stale times).
    timestamp: int = 0
    tenant: str = ""
    stream_id: str = ""
    endpoint_id: str | None = None  # None: an event row, to be routed
    event_id: int | None = None
    stream_seq: int | None = None
    traceparent: str | None = None
    tracestate: str | None = None
    partition_at: datetime | None = None  # names the row together with its id
    created_at: datetime | None = None  # when it was due: where the claim found it
    # An event row whose tenant had an endpoint of its own in the registry at the claim
    # (the routing has something to do); True where it was not asked.
    routable: bool = True

    @property
    def is_retry(self) -> bool:
        """Gated as a retry: a later attempt, or a replayed dead letter."""
        return self.attempt > 1 or self.replay

    @property
    def is_event(self) -> bool:
        return self.endpoint_id is None


@dataclass(frozen=True, slots=True)
class Completion:
    """What to write for one claimed row.

    ``delay_ms`` is the delay (from the database's clock) of the retry row, the deferral or
    the lease. ``endpoint_id`` names the endpoint of an event row delivered (or parked,
    deferred, leased) as the default endpoint's delivery. ``lease``: for a leased row, the
    lease to take; for a row recorded after its batch, the lease it must still hold.
    """

    id: int
    outcome: Outcome
    delay_ms: int = 0
    status_code: int | None = None
    error: str | None = None
    response_body: str | None = None
    duration_ms: float | None = None
    reason: str | None = None
    endpoint_id: str | None = None
    lease: uuid.UUID | None = None


@dataclass(frozen=True, slots=True)
class Recorded:
    """What :func:`complete` wrote."""

    processed: int = 0
    held: int = 0  # deferred, parked or leased
    retries: int = 0
    dead_letters: int = 0
    routed: int = 0  # delivery rows fanned out from the event rows
    unrouted: int = 0  # event rows that matched no endpoint (recorded ``unrouted``)
    # (endpoint, stream) pairs of ordered endpoints whose next head may now be chosen.
    ordered: list[tuple[str, str]] = field(default_factory=list)


async def claim_due(
    conn: psycopg.AsyncConnection[Any],
    batch: int,
    *,
    since: datetime | None = None,
    after: tuple[datetime, int] | None = None,
) -> list[Claimed]:
    """Lock up to ``batch`` due rows (``FOR UPDATE SKIP LOCKED``) in the open transaction.
    ``since``: on a partitioned outbox, the write time before which no row is pending (see
    :func:`fluxora_webhooks.partitions.pending_since`). ``after``: (created_at, id) of the
    last row of the loop's previous, full batch; only rows after it are looked at (see
    :class:`fluxora_webhooks.batch.Resume`)."""
    name = "claim_due" if since is None else "claim_due_partitioned"
    params: dict[str, Any] = {"since": since}
    if after is not None:
        params["after_at"], params["after_id"] = after
    started = time.monotonic()
    cur = await conn.execute(_claim_sql(name, batch=batch, resumed=after is not None), params)
    rows = [_claimed(r, routable=r[16] is not False) for r in await cur.fetchall()]
    await _replan_if_stale(conn, full=len(rows) == batch, took_s=time.monotonic() - started)
    return rows


# Prepared statements keep the plan made when they were first run: made while the outbox
# was nearly empty, the claim's is a scan of the whole table and a sort and complete_batch
# joins every row of the table to its batch, and they stay so as a burst grows the table,
# until an ANALYZE (autovacuum's, up to a minute later; never where autovacuum is off)
# invalidates them: a burst of 20,000 drained at 84 a second. A connection whose claims of
# full batches keep taking long deallocates its statements, which are planned again for
# the table as it is (868 a second; docs/performance.md, "Bursts and other tenants").
SLOW_CLAIM_S = 0.005
SLOW_CLAIMS_TO_REPLAN = 3
REPLAN_EVERY_S = 30.0


@dataclass
class _ClaimPace:
    """A connection's slow claims of full batches in a row, and its last replanning."""

    slow: int = 0
    replanned_at: float = float("-inf")


_claim_paces: weakref.WeakKeyDictionary[psycopg.AsyncConnection[Any], _ClaimPace] = (
    weakref.WeakKeyDictionary()
)


async def _replan_if_stale(
    conn: psycopg.AsyncConnection[Any], *, full: bool, took_s: float
) -> None:
    pace = _claim_paces.get(conn)
    if not (full and took_s > SLOW_CLAIM_S):
        if pace is not None:
            pace.slow = 0
        return
    if pace is None:
        pace = _claim_paces[conn] = _ClaimPace()
    pace.slow += 1
    now = time.monotonic()
    if pace.slow >= SLOW_CLAIMS_TO_REPLAN and now - pace.replanned_at >= REPLAN_EVERY_S:
        pace.slow, pace.replanned_at = 0, now
        await conn.execute("DEALLOCATE ALL")  # psycopg forgets its own statements too
        log.debug(
            "claims of full batches took over %.0f ms: statements planned again",
            SLOW_CLAIM_S * 1000,
        )


def _claimed(r: Sequence[Any], *, routable: bool = True) -> Claimed:
    """A row in the claim's columns."""
    return Claimed(
        int(r[0]),
        r[1],
        r[2],
        r[3].encode("utf-8"),
        int(r[4]),
        bool(r[5]),
        int(r[6]),
        r[7],
        r[8],
        r[9],
        r[10],
        r[11],
        r[12],
        r[13],
        r[14],
        r[15],
        routable,
    )


@dataclass(frozen=True, slots=True)
class Routing:
    """What :func:`route_events` wrote."""

    due: list[Claimed]  # delivery rows due now, to send in the same batch
    events: frozenset[int]  # the event rows that reached at least one endpoint
    # (endpoint, stream) pairs of ordered endpoints whose next head may now be chosen.
    ordered: list[tuple[str, str]]
    # Pairs whose delivery was made due as it was routed, with none waiting behind it:
    # no next head to choose for them, whatever becomes of it.
    fresh: frozenset[tuple[str, str]] = frozenset()


async def route_events(
    conn: psycopg.AsyncConnection[Any],
    events: Mapping[int, datetime | None],
    *,
    cap: int,
    heads: int = 0,
    claimed: Sequence[int] = (),
    since: datetime | None = None,
    locked: Collection[tuple[str, str]] = (),
) -> Routing:
    """Fan out the claimed event rows ``events`` (id: partition_at) in the open
    transaction; up to ``cap`` of the delivery rows due now come back to be sent in it:
    those just routed, then up to ``heads`` ordered streams' heads that are due (not among
    the batch's ``claimed`` rows; on a partitioned outbox, in partitions from ``since``).
    ``locked``: the ordered (endpoint, stream) pairs whose lock the transaction holds
    (:func:`try_lock_streams`); a delivery to one of them whose stream is idle is due at
    once, and comes back to be sent with the others."""
    known = [at for at in events.values() if at is not None]
    params = {
        "ids": pgarray.ints(events),
        "part_lo": min(known, default=_EPOCH),
        "part_hi": max(known, default=_EPOCH),
        "cap": cap,
        "heads": heads,
        "claimed": pgarray.ints(claimed),
        "since": since or _EPOCH,  # no partition_at is earlier
        "locked_endpoints": pgarray.texts(e for e, _ in locked),
        "locked_streams": pgarray.texts(s for _, s in locked),
    }
    # Native placeholders: the statement is longer than psycopg's parse cache takes (see
    # queries.native), and it runs on every batch that routes. The look at whether a stream
    # is idle is only in the form for a batch that holds some streams' locks: its lookups
    # cost the statement's start-up on every other batch.
    text, names = native("route_events", *((_IDLE_HEADS,) if locked else ()))
    cur = psycopg.AsyncRawCursor(conn)
    await cur.execute(text, [params[n] for n in names])
    rows = await cur.fetchall()
    first = rows[0]
    due = [_claimed(r) for r in rows if r[0] is not None]
    pairs = list(zip(first[17] or [], first[18] or [], strict=True))
    fresh = frozenset(zip(first[19] or [], first[20] or [], strict=True))
    return Routing(due, frozenset(first[16] or ()), pairs, fresh)


_CLAIM_ORDER = "ORDER BY created_at ASC, id ASC"
# route_events's fan-out when the batch holds some ordered streams' locks.
_IDLE_HEADS = ("fan_out_head", "fan_out_head_idle")


@cache
def _claim_sql(name: str, *, batch: int, resumed: bool) -> str:
    """The named claim of ``batch`` rows, or (``resumed``) the same claim starting after a
    position of its index: ``(created_at, id) > (after)``, an index condition of
    webhook_outbox_due_idx, so the scan begins there instead of walking the entries the
    loop's earlier batches left behind (dead until VACUUM removes them).

    The batch size is written into the text: with ``LIMIT $1`` PostgreSQL planned the
    prepared claim afresh on every execution (a generic plan's estimate for an unknown
    limit looks far costlier than the custom plan's), about 100 us of the database's CPU
    per batch; with a constant it keeps one plan (docs/performance.md, eighth pass)."""
    sql = query(name).replace("%(batch)s", str(int(batch)))
    if not resumed:
        return sql
    assert sql.count(_CLAIM_ORDER) == 1, f"{name}: one ORDER BY expected"
    bound = "  AND (created_at, id) > (%(after_at)s, %(after_id)s)\n"
    return sql.replace(_CLAIM_ORDER, bound + _CLAIM_ORDER)


async def next_due_in_ms(
    conn: psycopg.AsyncConnection[Any], *, since: datetime | None = None
) -> int | None:
    """Milliseconds until the earliest pending row is due, None when nothing is pending."""
    if since is None:
        cur = await conn.execute(query("next_due_in_ms"))
    else:
        cur = await conn.execute(query("next_due_in_ms_partitioned"), {"since": since})
    row = await cur.fetchone()
    return None if row is None or row[0] is None else max(0, int(row[0]))


async def relock_claimed(
    conn: psycopg.AsyncConnection[Any], rows: Mapping[int, datetime | None]
) -> set[int]:
    """Lock again, after a rolled-back batch, those of ``rows`` (id: partition_at) still
    unprocessed and not held by another transaction; returns their ids."""
    cur = await conn.execute(
        query("relock_claimed"),
        {"ids": pgarray.ints(rows), "parts": pgarray.timestamps(rows.values())},
    )
    return {int(row[0]) for row in await cur.fetchall()}


async def bring_forward(
    conn: psycopg.AsyncConnection[Any], rows: Mapping[int, datetime | None]
) -> int:
    """Make those of ``rows`` (id: partition_at) that are still deferred due now; returns
    how many (see the bring_forward query)."""
    cur = await conn.execute(
        query("bring_forward"),
        {"ids": pgarray.ints(rows), "parts": pgarray.timestamps(rows.values())},
    )
    return cur.rowcount


# The outcomes complete_batch's "done" and "held" parts write (their "r.outcome IN (...)"
# filters): a batch with none of one set gets that part's empty form.
_WRITES = frozenset({Outcome.DELIVERED, Outcome.RETRY, Outcome.DEAD_LETTER, Outcome.ROUTED})
_HOLDS = frozenset({Outcome.DEFERRED, Outcome.PARKED, Outcome.LEASED})


def complete_statement(
    completions: Sequence[Completion],
    parts: Mapping[int, datetime | None],
    *,
    route: Sequence[int] = (),
    prerouted: Collection[int] = (),
    succeeded: Sequence[str] = (),
    failed: Sequence[str] = (),
    general: bool = False,
) -> tuple[str, list[Any]]:
    """The statement :func:`complete` runs and its parameters (native ``$n`` placeholders,
    for a :class:`psycopg.AsyncRawCursor`): ``complete_batch`` with the empty form of each
    part that would write nothing for this batch (every part with ``general``)."""
    known = [at for c in completions if (at := parts[c.id]) is not None]
    failed = [e for e in failed if e not in succeeded]
    outcomes = {c.outcome for c in completions}
    needed = {
        "complete_routing": bool(route),
        "complete_done": not outcomes.isdisjoint(_WRITES),
        "complete_held": not outcomes.isdisjoint(_HOLDS),
        "complete_retried": Outcome.RETRY in outcomes,
        "complete_dead": Outcome.DEAD_LETTER in outcomes,
        "complete_streak_ended": bool(succeeded),
        "complete_streak_started": bool(failed),
    }
    empty = () if general else tuple((p, f"{p}_none") for p, need in needed.items() if not need)
    text, names = native("complete_batch", *empty)
    params: dict[str, Any] = {
        # Array literals (pgarray): psycopg's list dumping cost more than all the rest.
        "ids": pgarray.ints(c.id for c in completions),
        "outcomes": pgarray.texts(c.outcome.value for c in completions),
        "delays": pgarray.ints(c.delay_ms for c in completions),
        "codes": pgarray.ints(c.status_code for c in completions),
        "errors": pgarray.texts(c.error for c in completions),
        "bodies": pgarray.texts(c.response_body for c in completions),
        "durations": pgarray.floats(c.duration_ms for c in completions),
        "reasons": pgarray.texts(c.reason for c in completions),
        "endpoints": pgarray.texts(c.endpoint_id for c in completions),
        "leases": pgarray.uuids(c.lease for c in completions),
        "parts": pgarray.timestamps(parts[c.id] for c in completions),
        "part_lo": min(known, default=_EPOCH),
        "part_hi": max(known, default=_EPOCH),
        "route": pgarray.ints(route),
        "prerouted": pgarray.ints(prerouted),
        "succeeded": pgarray.texts(succeeded),
        "failed": pgarray.texts(failed),
    }
    return text, [params[n] for n in names]


async def complete(
    conn: psycopg.AsyncConnection[Any],
    completions: Sequence[Completion],
    parts: Mapping[int, datetime | None],
    *,
    route: Sequence[int] = (),
    prerouted: Collection[int] = (),
    succeeded: Sequence[str] = (),
    failed: Sequence[str] = (),
) -> Recorded:
    """Write every outcome of a batch in one statement, and route its event rows ``route``
    (whatever their own outcome). ``prerouted``: event rows :func:`route_events` already
    routed to at least one endpoint (an event row with a ``routed`` outcome in neither is
    marked ``unrouted``). ``parts``: each row's ``partition_at`` by id (with its id, it
    names the row). ``succeeded`` / ``failed``: the endpoints that had a delivered / a
    failed attempt, whose failure streak (``failing_since``) ends / starts.
    """
    text, params = complete_statement(
        completions, parts, route=route, prerouted=prerouted, succeeded=succeeded, failed=failed
    )
    cur = psycopg.AsyncRawCursor(conn)
    await cur.execute(text, params)
    row = await cur.fetchone()
    assert row is not None
    pairs = list(zip(row[5] or [], row[6] or [], strict=True))
    return Recorded(
        int(row[0]), int(row[1]), int(row[2]), int(row[3]), int(row[4]), int(row[9]), pairs
    )


def _pair_params(pairs: Collection[tuple[str, str]]) -> dict[str, str]:
    """(endpoint, stream) pairs as the stream-lock statements take them: once each, in key
    order, as two parallel arrays."""
    unique = sorted(set(pairs))
    return {
        "endpoints": pgarray.texts(e for e, _ in unique),
        "streams": pgarray.texts(s for _, s in unique),
    }


# How many ordered streams' locks one transaction takes to choose or make due their heads.
# Each is an advisory lock, an entry of the server's one lock table (about
# max_locks_per_transaction x max_connections entries, 6,400 by default), which every
# session of every database shares: a transaction that takes thousands made the others'
# (a producer's among them) fail with "out of shared memory". A dispatcher's transaction
# takes at most twice this many (routing, then the completion's heads): the streams past
# it have their heads chosen after the commit, in transactions of PROMOTE_CHUNK each.
MAX_STREAM_LOCKS = 128
PROMOTE_CHUNK = 256


async def promote_heads(
    conn: psycopg.AsyncConnection[Any], pairs: Sequence[tuple[str, str]]
) -> int:
    """Choose the next head of each ordered (endpoint, stream) that has none, under a
    per-pair advisory lock, so a routing and a completion of the same stream never both
    decide (or both miss) it. On a connection in a transaction, in that transaction, after
    its other writes; on an idle one, PROMOTE_CHUNK streams per transaction, each
    committed before the next takes its locks (an endpoint enabled with thousands of
    parked streams). Returns how many deliveries became due."""
    if not pairs:
        return 0
    unique = sorted(set(pairs))
    idle = conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    if not idle or (conn.autocommit and len(unique) <= PROMOTE_CHUNK):
        cur = await conn.execute(query("promote_heads"), _pair_params(unique))
        return len(await cur.fetchall())
    promoted, failed = 0, None
    for start in range(0, len(unique), PROMOTE_CHUNK):
        try:
            async with conn.transaction():
                chunk = _pair_params(unique[start : start + PROMOTE_CHUNK])
                cur = await conn.execute(query("promote_heads"), chunk)
                promoted += len(await cur.fetchall())
        except psycopg.Error as exc:  # the others' heads are chosen all the same
            if conn.broken:
                raise
            failed = failed or exc
    if failed is not None:
        raise failed
    return promoted


async def promote_handed_over(
    conn: psycopg.AsyncConnection[Any], *, pairs: Sequence[tuple[str, str]]
) -> int:
    """On an idle connection, the heads of the streams a dispatcher's transactions left to
    after their commits (held elsewhere, or past MAX_STREAM_LOCKS): first without waiting
    for a lock (each statement its own transaction; most such streams are nobody's), then,
    waiting, those another transaction holds. Returns how many deliveries became due."""
    unique = sorted(set(pairs))
    promoted, held = 0, []
    for start in range(0, len(unique), MAX_STREAM_LOCKS):
        chosen, busy = await try_promote_heads(conn, unique[start : start + MAX_STREAM_LOCKS])
        promoted += chosen
        held.extend(busy)
    return promoted + await promote_heads(conn, held)


async def promote_after_commit(
    conn: psycopg.AsyncConnection[Any], pairs: Sequence[tuple[str, str]]
) -> int:
    """:func:`promote_heads` on an idle connection after the caller's commit (an enable, a
    recovery, a replay): what was committed stands whatever happens here, so a failure is
    logged, not raised, and the dispatchers' sweep chooses those heads (every 30 s)."""
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        return await promote_heads(conn, pairs)  # the caller's transaction: its to handle
    try:
        return await promote_heads(conn, pairs)
    except psycopg.Error as exc:
        log.warning(
            "the next heads of %d ordered stream(s) were not chosen (%s); the dispatchers'"
            " sweep chooses them within a minute",
            len(set(pairs)),
            type(exc).__name__,
        )
        return 0


async def try_lock_streams(
    conn: psycopg.AsyncConnection[Any], pairs: Collection[tuple[str, str]]
) -> set[tuple[str, str]]:
    """Take, without waiting, the lock of each ordered (endpoint, stream) in ``pairs`` for
    the open transaction, at most MAX_STREAM_LOCKS of them; returns those it got (see
    :func:`route_events`: a stream not locked has its delivery wait, its head chosen by
    the batch's completion or after its commit)."""
    if not pairs:
        return set()
    params = _pair_params(sorted(set(pairs))[:MAX_STREAM_LOCKS])
    cur = await conn.execute(query("try_lock_streams"), params)
    return {(str(e), str(s)) for e, s in await cur.fetchall()}


async def try_promote_heads(
    conn: psycopg.AsyncConnection[Any], pairs: Sequence[tuple[str, str]]
) -> tuple[int, list[tuple[str, str]]]:
    """:func:`promote_heads` inside a dispatcher's transaction, which never waits for a
    stream's lock (migration 0011): returns how many deliveries became due, and the pairs
    whose lock another transaction holds (or past MAX_STREAM_LOCKS), to promote after the
    commit."""
    if not pairs:
        return 0, []
    unique = sorted(set(pairs))
    # Past MAX_STREAM_LOCKS, as if another transaction held their locks: after the commit.
    params = _pair_params(unique[:MAX_STREAM_LOCKS])
    cur = await conn.execute(query("try_promote_heads"), params)
    promoted, busy = 0, unique[MAX_STREAM_LOCKS:]
    for head, endpoint_id, stream_id in await cur.fetchall():
        if head is not None:
            promoted += 1
        else:
            busy.append((str(endpoint_id), str(stream_id)))
    return promoted, busy
