"""The consumer's side of exactly-once: a transactional inbox (SPEC 17).

Delivery is at least once: after a timeout, a crash or a lost response the same event
arrives again, with the same delivery id. :func:`receive` verifies a request and records its
delivery id in ``webhook_inbox`` **inside the consumer's own transaction**; the consumer's
writes in that transaction then happen once per delivery id, however often it arrives::

    with conn.transaction():
        event = inbox.receive(conn, body=body, headers=headers, secret=SECRET)
        if event is not None:  # None: already received (and applied) before
            conn.execute("UPDATE balances SET amount = amount + %s", (event.payload["amount"],))
    # async: event = await inbox.receive(aconn, ...)

If the transaction rolls back (the handler failed, the process died before the commit), the
delivery id goes with it and the next attempt applies the event. If it commits and the
response is lost, the next attempt finds the id and gets None: answer 2xx so the sender stops.

Framework glue: :mod:`fluxora_webhooks.inbox.aiohttp` and :mod:`fluxora_webhooks.inbox.asgi`
(Starlette/FastAPI, the ``asgi`` extra). The table: :func:`install`; keeping it small:
:func:`prune` (``fluxora-webhooks inbox install | prune``). See ``docs/consumers.md``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import re
import weakref
from collections.abc import Awaitable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias, overload

import psycopg
from psycopg.pq import TransactionStatus
from psycopg.rows import tuple_row

from ..errors import FluxoraError, SchemaError, VerificationError
from ..queries import query
from ..retention import MAX_OLDER_THAN_MS
from ..signing import DEFAULT_TOLERANCE_SECONDS, Verified, verify_request

__all__ = [
    "DEFAULT_PRUNE_BATCH",
    "Headers",
    "InboxEvent",
    "InboxPruneResult",
    "Installed",
    "TransactionAborted",
    "check_committable",
    "install",
    "install_report",
    "prune",
    "receive",
]

#: Request headers: any mapping (a dict, aiohttp's multidict, Django's ``request.headers``)
#: or a sequence of raw ``(name, value)`` pairs (an ASGI scope's ``headers``).
Headers: TypeAlias = Mapping[str, str] | Sequence[tuple[bytes | str, bytes | str]]

# Fixed, like the migration lock: "fluxora-webhooks inbox".
INBOX_LOCK_KEY = 0x666C7578696E62
DEFAULT_PRUNE_BATCH = 5000
MAX_PRUNE_BATCH = 100_000
# Far above any id a sender uses, far below what a btree entry can hold.
MAX_DELIVERY_ID_CHARS = 255
_ATTEMPT = re.compile(r"[0-9]{1,9}", re.ASCII)
MISSING_TABLE = (
    "the webhook_inbox table does not exist in this database: run "
    "`fluxora-webhooks inbox install` (or fluxora_webhooks.inbox.install(conn)) first"
)
NO_ID = (
    "webhook_inbox has no delivery_id column, so it is not the inbox's table: rename or "
    "drop it, then install again"
)
NOT_TEXT = (
    "webhook_inbox.delivery_id is {type}, not text: receive stores each delivery id as "
    "text of up to {chars} characters (any sender's id, not only a UUID), which that type "
    "refuses or changes: make it text (ALTER TABLE webhook_inbox ALTER COLUMN delivery_id "
    "TYPE text), then install again"
)
NO_KEY = (
    "webhook_inbox has no primary key or unique index on delivery_id, which the inbox "
    "needs to tell a repeat from a new event: add one (ALTER TABLE webhook_inbox ADD "
    "PRIMARY KEY (delivery_id))"
)


@dataclass(frozen=True, slots=True)
class InboxEvent:
    """A verified delivery, received for the first time.

    ``delivery_id`` is signed by the Standard Webhooks scheme (not by the x-fluxora one);
    ``payload`` is the parsed body, which both schemes sign. ``event_type`` and ``attempt``
    come from the unsigned ``x-fluxora-event`` and ``x-fluxora-attempt`` headers (None when
    absent or unreadable): use them for routing and logs, keep decisions on the payload.
    """

    delivery_id: str
    event_type: str | None
    attempt: int | None
    payload: Any


@dataclass(frozen=True, slots=True)
class InboxPruneResult:
    """What one :func:`prune` run deleted (or, for a dry run, would delete)."""

    cutoff: dt.datetime
    deleted: int
    batches: int
    dry_run: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "cutoff": self.cutoff.isoformat(),
            "deleted": self.deleted,
            "batches": self.batches,
            "dry_run": self.dry_run,
        }


# -- install ------------------------------------------------------------------------------


@overload
def install(conn: psycopg.Connection[Any]) -> bool: ...


@overload
def install(conn: psycopg.AsyncConnection[Any]) -> Awaitable[bool]: ...


def install(
    conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any],
) -> bool | Awaitable[bool]:
    """Create ``webhook_inbox`` (and its index) if missing; True if the table was created.

    Idempotent and safe to run from several places at once (an advisory lock serialises
    the installs). On a connection with a transaction open, it takes part in it.
    """
    if isinstance(conn, psycopg.AsyncConnection):
        return _created(install_report(conn))
    # Its rows read by position, whatever the connection's row factory (dict_row...).
    with conn.transaction(), conn.cursor(row_factory=tuple_row) as cur:
        cur.execute(query("inbox_lock"), {"key": INBOX_LOCK_KEY})
        shape = cur.execute(query("inbox_shape"), _SHAPE_PARAMS).fetchone()
        for step in _install_steps(shape):
            cur.execute(step)
    return shape is None


@dataclass(frozen=True)
class Installed:
    """What :func:`install_report` did: the table created, or the columns it added to an
    existing one (none: it was installed already)."""

    created: bool
    added: tuple[str, ...] = ()


def install_report(conn: psycopg.AsyncConnection[Any]) -> Coroutine[Any, Any, Installed]:
    """:func:`install`, saying what it did (``fluxora-webhooks inbox install``). Await it,
    on an ``AsyncConnection`` (``TypeError`` otherwise)."""
    _require_async(
        conn,
        "install_report",
        "inbox.install(conn) takes a sync one, `fluxora-webhooks inbox install` a shell",
    )
    return _install_report(conn)


async def _install_report(conn: psycopg.AsyncConnection[Any]) -> Installed:
    async with conn.transaction(), conn.cursor(row_factory=tuple_row) as cur:  # as install's
        await cur.execute(query("inbox_lock"), {"key": INBOX_LOCK_KEY})
        shape = await (await cur.execute(query("inbox_shape"), _SHAPE_PARAMS)).fetchone()
        for step in _install_steps(shape):
            await cur.execute(step)
    return Installed(created=True) if shape is None else Installed(False, tuple(shape[3]))


async def _created(report: Awaitable[Installed]) -> bool:
    return (await report).created


def _install_steps(shape: tuple[Any, ...] | None) -> list[str]:
    """What install runs, given ``inbox_shape``'s reading (None: no table yet): the
    columns it lacks added first (then only), then the table and its index if missing."""
    _check_shape(shape)
    missing = shape is not None and bool(shape[3])
    return [query("inbox_add_columns")] * missing + [query("inbox_install")]


def _check_shape(shape: tuple[Any, ...] | None) -> None:
    """A table of that name made by hand that receive could never use is named, not
    reported as installed: install completes columns, not a missing id or key, nor an id
    that is not text."""
    if shape is None:  # no such table yet: install creates it whole
        return
    id_type, holds_every_id, has_key, _ = shape
    if id_type is None:
        raise SchemaError(NO_ID)
    if not holds_every_id:
        raise SchemaError(NOT_TEXT.format(type=id_type, chars=MAX_DELIVERY_ID_CHARS))
    if not has_key:
        raise SchemaError(NO_KEY)


# inbox_shape's parameter: the longest id receive stores, which delivery_id must hold.
_SHAPE_PARAMS = {"id_chars": MAX_DELIVERY_ID_CHARS}


# -- receive ------------------------------------------------------------------------------


@overload
def receive(
    conn: psycopg.Connection[Any],
    *,
    body: bytes,
    headers: Headers,
    secret: str | bytes,
    previous_secret: str | bytes | None = None,
    tolerance_s: int = DEFAULT_TOLERANCE_SECONDS,
    scheme: str = "auto",
    now: float | None = None,
) -> InboxEvent | None: ...


@overload
def receive(
    conn: psycopg.AsyncConnection[Any],
    *,
    body: bytes,
    headers: Headers,
    secret: str | bytes,
    previous_secret: str | bytes | None = None,
    tolerance_s: int = DEFAULT_TOLERANCE_SECONDS,
    scheme: str = "auto",
    now: float | None = None,
) -> Awaitable[InboxEvent | None]: ...


def receive(
    conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any],
    *,
    body: bytes,
    headers: Headers,
    secret: str | bytes,
    previous_secret: str | bytes | None = None,
    tolerance_s: int = DEFAULT_TOLERANCE_SECONDS,
    scheme: str = "auto",
    now: float | None = None,
) -> InboxEvent | Awaitable[InboxEvent | None] | None:
    """Verify a received webhook and record its delivery id in the caller's transaction.

    Returns the event the first time its delivery id is received, and None for every
    later copy. Verification is :func:`fluxora_webhooks.verify`'s (either scheme,
    constant time, ``tolerance_s`` seconds of clock difference, ``secret`` or
    ``previous_secret``; ``scheme="standard"`` to require the scheme that signs the
    delivery id) and fails with the same :class:`VerificationError`. Two more reasons are
    the inbox's own: ``bad_payload`` (the signed body is not JSON) and ``bad_delivery_id``
    (an id the table cannot store: NUL, invalid UTF-8, over 255 characters). A failure
    records nothing.

    ``conn`` must have a transaction open (``with conn.transaction():``, or a connection
    that is not in autocommit mode): the point is that the id commits or rolls back with
    the consumer's own writes. An autocommit connection outside a transaction block raises
    ``ValueError`` before anything is read or written.

    While another transaction holds the same delivery id uncommitted (the same event
    delivered twice at once), this call waits for it: its commit makes this call return
    None, its rollback lets this one record the id and return the event. Under REPEATABLE
    READ or SERIALIZABLE, PostgreSQL reports that case as a serialization failure instead:
    roll back and answer 5xx, and the next attempt is a plain repeat.

    With an ``AsyncConnection``, await it. A missing table raises :class:`SchemaError`.
    """
    _require_transaction(conn)
    event = _verified_event(
        body,
        headers,
        secret,
        previous=previous_secret,
        tolerance=tolerance_s,
        now=now,
        scheme=scheme,
    )
    params = {
        "delivery_id": event.delivery_id,
        "event_type": event.event_type,
        "attempt": event.attempt,
    }
    if isinstance(conn, psycopg.AsyncConnection):
        return _receive_async(conn, event, params)
    try:
        row = conn.execute(query("inbox_receive"), params).fetchone()
    except _RECEIVE_FAULTS as exc:
        raise _schema_error(exc) from exc
    if row is None and conn in _RECORDED_IN:
        current = conn.execute(query("inbox_current_transaction")).fetchone()
        _duplicate_seen(conn, current[0] if current else None)
    return _received(conn, event, row)


# The transaction each connection recorded ids in (inbox_receive), and every id it
# recorded there, for check_committable; kept no longer than the connection.
_RECORDED_IN: weakref.WeakKeyDictionary[object, tuple[str, list[str]]] = weakref.WeakKeyDictionary()


def _received(
    conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any],
    event: InboxEvent,
    row: tuple[Any, ...] | None,
) -> InboxEvent | None:
    """Note the id the row says was recorded, beside the ids recorded earlier in the same
    transaction (a handler may receive several deliveries in one)."""
    if row is None:
        return None
    transaction = str(row[0])
    recorded = _RECORDED_IN.get(conn)
    if recorded is not None and recorded[0] == transaction:
        if event.delivery_id not in recorded[1]:  # received again after its savepoint rolled back
            recorded[1].append(event.delivery_id)
    else:
        _RECORDED_IN[conn] = (transaction, [event.delivery_id])
    return event


def _duplicate_seen(
    conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any], transaction: str | None
) -> None:
    """A copy received again: the ids recorded earlier stay checked if they were recorded
    in this same transaction (``transaction``, the current one's id if it has one), and
    are forgotten if they belong to one that ended."""
    recorded = _RECORDED_IN.get(conn)
    if recorded is not None and recorded[0] != transaction:
        del _RECORDED_IN[conn]


class TransactionAborted(FluxoraError, RuntimeError):
    """The transaction an event was received in cannot commit it (:func:`check_committable`)."""


@overload
def check_committable(conn: psycopg.Connection[Any]) -> None: ...


@overload
def check_committable(conn: psycopg.AsyncConnection[Any]) -> Awaitable[None]: ...


def check_committable(
    conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any],
) -> Awaitable[None] | None:
    """Raise :class:`TransactionAborted` unless ``conn``'s transaction can still commit the
    received id with the writes it guards. Call it after your writes, before the commit;
    with an ``AsyncConnection``, await it.

    A database error caught inside the transaction (``except UniqueViolation: pass``
    around a statement) aborts it, and PostgreSQL then answers its COMMIT by rolling back,
    without an error: the id and every write are gone while the code goes on to answer
    2xx, and the sender stops. Catch database errors inside a savepoint instead
    (``with conn.transaction():`` around the statement), which leaves the outer
    transaction usable. A ROLLBACK or COMMIT run as SQL by the handler is refused too,
    also when the handler wrote again after it (on a connection not in autocommit mode,
    the next statement begins a new transaction, which would commit those writes without
    the id), and so is a savepoint rolled back with the id in it: the transaction is
    compared with the one :func:`receive` recorded the id in, and the id looked up (one
    short query; in a pipeline, it syncs the pipeline first). A transaction that receives
    several deliveries has every id it recorded checked."""
    _check_status(conn.info.transaction_status, pipelined=True)
    recorded = _RECORDED_IN.get(conn)
    params = {"delivery_ids": recorded[1] if recorded is not None else None}
    if isinstance(conn, psycopg.AsyncConnection):
        return _check_committable_async(conn, recorded, params)
    if recorded is not None or conn.info.transaction_status == TransactionStatus.ACTIVE:
        try:
            row = conn.execute(query("inbox_transaction"), params).fetchone()
        except psycopg.Error as exc:  # a pipelined statement's error, synced only now
            raise _aborted(TransactionStatus.INERROR) from exc
        _check_status(conn.info.transaction_status)
        _check_same_transaction(recorded, row)
    return None


_ENDED = (
    "the transaction the event was received in was ended by a COMMIT or ROLLBACK of its"
    " own: the id no longer commits with the writes it guards"
)


def _aborted(status: TransactionStatus) -> TransactionAborted:
    if status == TransactionStatus.INERROR:
        return TransactionAborted(
            "a database error inside the transaction was caught without a savepoint, so"
            " the transaction cannot commit: the event was not applied (catch database"
            " errors inside a nested `with conn.transaction():`)"
        )
    return TransactionAborted(_ENDED)


def _check_status(status: TransactionStatus, *, pipelined: bool = False) -> None:
    """In a transaction that can commit (``pipelined``: or one whose statements are still
    being sent in a pipeline, ACTIVE, which the query syncs)."""
    if status == TransactionStatus.INTRANS:
        return
    if pipelined and status == TransactionStatus.ACTIVE:
        return
    raise _aborted(status)


async def _check_committable_async(
    conn: psycopg.AsyncConnection[Any],
    recorded: tuple[str, list[str]] | None,
    params: dict[str, Any],
) -> None:
    if recorded is not None or conn.info.transaction_status == TransactionStatus.ACTIVE:
        try:
            row = await (await conn.execute(query("inbox_transaction"), params)).fetchone()
        except psycopg.Error as exc:
            raise _aborted(TransactionStatus.INERROR) from exc
        _check_status(conn.info.transaction_status)
        _check_same_transaction(recorded, row)


def _check_same_transaction(
    recorded: tuple[str, list[str]] | None, row: tuple[Any, ...] | None
) -> None:
    if recorded is None:
        return
    if row is None or row[0] is None or str(row[0]) != recorded[0]:
        raise TransactionAborted(_ENDED)
    if not row[1]:
        raise TransactionAborted(
            "the savepoint the event's id was recorded in was rolled back: the id no longer"
            " commits with the writes it guards (receive it outside the savepoint, or again)"
        )


async def _receive_async(
    conn: psycopg.AsyncConnection[Any], event: InboxEvent, params: dict[str, Any]
) -> InboxEvent | None:
    try:
        row = await (await conn.execute(query("inbox_receive"), params)).fetchone()
    except _RECEIVE_FAULTS as exc:
        raise _schema_error(exc) from exc
    if row is None and conn in _RECORDED_IN:
        current = await (await conn.execute(query("inbox_current_transaction"))).fetchone()
        _duplicate_seen(conn, current[0] if current else None)
    return _received(conn, event, row)


# What a webhook_inbox that install did not make can lack: the table, a column receive
# writes, the primary key its ON CONFLICT needs.
_SCHEMA_FAULTS = (
    psycopg.errors.UndefinedTable,
    psycopg.errors.UndefinedColumn,
    psycopg.errors.InvalidColumnReference,
)
# And for receive, a column whose type cannot take what it writes (an integer or uuid
# delivery_id, a varchar too short): install names a delivery_id that is not text.
_RECEIVE_FAULTS = (
    *_SCHEMA_FAULTS,
    psycopg.errors.InvalidTextRepresentation,
    psycopg.errors.StringDataRightTruncation,
    psycopg.errors.DatatypeMismatch,
)


def _schema_error(exc: psycopg.Error) -> SchemaError:
    if isinstance(exc, psycopg.errors.UndefinedTable):
        return SchemaError(MISSING_TABLE)
    if isinstance(exc, psycopg.errors.UndefinedColumn):
        what = exc.diag.message_primary or "a column the inbox writes is missing"
        return SchemaError(
            f"webhook_inbox is not the inbox's table ({what}): `fluxora-webhooks inbox "
            "install` (or fluxora_webhooks.inbox.install(conn)) adds event_type, attempt "
            "and received_at to it; a table without delivery_id is not one it can complete"
        )
    if isinstance(exc, psycopg.errors.DataError | psycopg.errors.DatatypeMismatch):
        what = exc.diag.message_primary or type(exc).__name__
        return SchemaError(
            f"webhook_inbox cannot store this delivery ({what}): a column made by hand has "
            "another type than install gives it (delivery_id and event_type text, attempt "
            "integer); `fluxora-webhooks inbox install` names a delivery_id that is not text"
        )
    return SchemaError(NO_KEY)


def _require_async(conn: object, name: str, instead: str) -> None:
    """For the functions that are async only: said at the call, since a coroutine made for
    a sync connection would never run, and do nothing without a word."""
    if not isinstance(conn, psycopg.AsyncConnection):
        raise TypeError(f"inbox.{name} needs a psycopg AsyncConnection (await it); {instead}")


def _require_transaction(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    if not isinstance(conn, psycopg.Connection | psycopg.AsyncConnection):
        raise TypeError("conn must be a psycopg Connection or AsyncConnection")
    # Autocommit outside a transaction block would commit the id on its own, before the
    # consumer's writes: a crash in between would lose the event for good.
    if conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE:
        raise ValueError(
            "receive() needs an open transaction: call it inside `with conn.transaction():` "
            "(or on a connection that is not in autocommit mode), next to your own writes"
        )


def _header_mapping(headers: Headers) -> Mapping[str, Any]:
    """The headers as a mapping :func:`fluxora_webhooks.verify` reads: raw ``(name,
    value)`` pairs become a dict (the first occurrence of a name wins, as for a multidict);
    a mapping, or anything else, is passed through unchanged."""
    if isinstance(headers, list | tuple):
        pairs: dict[Any, Any] = {}
        for item in headers:
            if isinstance(item, tuple | list) and len(item) == 2:
                pairs.setdefault(item[0], item[1])
        return pairs
    return headers  # type: ignore[return-value]  # a mapping, or garbage for verify to refuse


def _verified_event(
    body: bytes,
    headers: Headers,
    secret: str | bytes,
    *,
    previous: str | bytes | None,
    tolerance: int,
    now: float | None,
    scheme: str,
) -> InboxEvent:
    verified = verify_request(
        body,
        _header_mapping(headers),
        secret,
        previous=previous,
        tolerance=tolerance,
        now=now,
        scheme=scheme,
    )
    _check_delivery_id(verified.delivery_id)
    try:
        payload = json.loads(bytes(body))
    except (ValueError, RecursionError):  # not JSON, or beyond what json will parse
        raise VerificationError("bad_payload", "the signed body is not JSON") from None
    return InboxEvent(verified.delivery_id, _event_type(verified), _attempt(verified), payload)


def _check_delivery_id(delivery_id: str) -> None:
    try:
        delivery_id.encode("utf-8")  # strict: a lone surrogate is not storable text
    except UnicodeEncodeError:
        ok = False
    else:
        ok = "\x00" not in delivery_id and len(delivery_id) <= MAX_DELIVERY_ID_CHARS
    if not ok:
        raise VerificationError(
            "bad_delivery_id",
            f"the delivery id is not text the inbox can store (NUL, invalid UTF-8 or over "
            f"{MAX_DELIVERY_ID_CHARS} characters)",
        )


def _event_type(verified: Verified) -> str | None:
    value = (verified.headers.get("x-fluxora-event") or "").strip()
    if not value.isascii():
        # The dispatcher writes the header in UTF-8; ASGI and WSGI servers hand its bytes
        # over decoded as ISO-8859-1, aiohttp as UTF-8 (which this leaves as it is).
        with contextlib.suppress(UnicodeError):
            value = value.encode("latin-1").decode("utf-8")
    # Not printable includes control characters and lone surrogates (undecodable bytes).
    return value if value and value.isprintable() else None


def _attempt(verified: Verified) -> int | None:
    value = (verified.headers.get("x-fluxora-attempt") or "").strip()
    if not _ATTEMPT.fullmatch(value) or int(value) < 1:
        return None
    return int(value)


# -- prune --------------------------------------------------------------------------------


def prune(
    conn: psycopg.AsyncConnection[Any],
    *,
    older_than_ms: int,
    batch_size: int = DEFAULT_PRUNE_BATCH,
    dry_run: bool = False,
) -> Coroutine[Any, Any, InboxPruneResult]:
    """Delete the delivery ids received more than ``older_than_ms`` ago, ``batch_size``
    rows per transaction (``conn`` must be an ``AsyncConnection`` in autocommit mode),
    oldest first. Await it.

    An id pruned while its event can still arrive again is an id the inbox forgets: keep
    them longer than the sender's whole retry window (about a day and a half with the
    default schedule) plus any time in which dead letters may be replayed.
    """
    _require_async(
        conn, "prune", "`fluxora-webhooks inbox prune` runs it from a shell or a cron job"
    )
    return _prune(conn, older_than_ms=older_than_ms, batch_size=batch_size, dry_run=dry_run)


async def _prune(
    conn: psycopg.AsyncConnection[Any],
    *,
    older_than_ms: int,
    batch_size: int,
    dry_run: bool,
) -> InboxPruneResult:
    if not 0 <= older_than_ms <= MAX_OLDER_THAN_MS:
        raise ValueError("older_than_ms must be from 0 to 100 years")
    if not 1 <= batch_size <= MAX_PRUNE_BATCH:
        raise ValueError(f"batch_size must be between 1 and {MAX_PRUNE_BATCH}")
    if not conn.autocommit:
        raise ValueError("prune needs a connection in autocommit mode (one transaction a batch)")
    async with conn.cursor(row_factory=tuple_row) as cur:  # as install's
        return await _prune_batches(cur, older_than_ms, batch_size, dry_run)


async def _prune_batches(
    cur: psycopg.AsyncCursor[tuple[Any, ...]], older_than_ms: int, batch_size: int, dry_run: bool
) -> InboxPruneResult:
    # One cutoff for the whole run, from the database's clock: the run ends even while
    # new ids keep ageing past the period.
    await cur.execute(query("retention_cutoff"), {"older_than_ms": older_than_ms})
    row = await cur.fetchone()
    assert row is not None
    cutoff: dt.datetime = row[0]
    try:
        if dry_run:
            await cur.execute(query("inbox_prune_count"), {"cutoff": cutoff})
            counted = await cur.fetchone()
            return InboxPruneResult(cutoff, int(counted[0]) if counted else 0, 0, dry_run=True)
        deleted = batches = 0
        while True:
            await cur.execute(query("inbox_prune"), {"cutoff": cutoff, "batch": batch_size})
            done = await cur.fetchone()
            count = int(done[0]) if done else 0
            deleted += count
            batches += 1
            if count < batch_size:
                return InboxPruneResult(cutoff, deleted, batches)
    except _SCHEMA_FAULTS as exc:
        raise _schema_error(exc) from exc
