"""Events, deliveries and their attempts, replay and statistics (SPEC 15): the admin layer
the API and the dashboard call (``sql/deliveries.sql``), beside :mod:`.endpoints`.

Every function takes ``tenant``: ``None`` acts for every tenant (an admin), a string
restricts the call to that tenant in the SQL itself, so another tenant's event or delivery
is not found (:class:`NotFoundError`). Filters are separate keywords (``tenant_filter``,
...): ``None`` filters nothing. Lists are pages, newest first: ``before`` is the ``seq``
of the last item of the previous page, and each call returns (items, the next ``before``
or None).

A delivery's status: ``pending`` (not attempted yet), ``retrying`` (attempted, or replayed,
and due again), ``parked`` (its endpoint is disabled), ``delivered`` or ``dead_letter``.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from .delivery import HELD_WORDS
from .endpoints import DEFAULT_ID, OPERATOR_TENANT, ClientCert, Endpoint, check_event_type
from .endpoints import get as get_endpoint
from .errors import ConfigError, ConflictError, IdempotencyKeyReused, NotFoundError
from .outbox import (
    MAX_PAYLOAD_DEPTH,
    enqueue_with_context,
    payload_too_deep,
    promote_after_commit,
)
from .pgtypes import TOO_DEEP
from .queries import query
from .secretbox import Key, Keyring, SecretLocked
from .tracing import delivery_trace_id, traceparent_header

STATUSES = ("pending", "retrying", "parked", "delivered", "dead_letter")
MAX_PAGE = 1000
# Counts in statistics stop here (as the service's gauges do): bounded work per request.
STATS_COUNT_CAP = 100_000
MAX_WINDOW_MS = 7 * 86_400_000
# How long a replay waits for a batch that is sending the same delivery right now.
REPLAY_LOCK_TIMEOUT = "5s"


def _scope(tenant: str | None) -> dict[str, Any]:
    return {"scoped": tenant is not None, "tenant": tenant if tenant is not None else ""}


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _tenant(value: str) -> str | None:
    return None if value == OPERATOR_TENANT else value


def _check_limit(limit: int) -> None:
    if not 1 <= limit <= MAX_PAGE:
        raise ConfigError("limit", f"must be from 1 to {MAX_PAGE}")


async def _rows(
    conn: psycopg.AsyncConnection[Any], name: str, params: Mapping[str, Any]
) -> list[dict[str, Any]]:
    cur = conn.cursor(row_factory=dict_row)
    await cur.execute(query(name), params)
    return list(await cur.fetchall())


def _page(
    rows: list[dict[str, Any]], limit: int, key: str
) -> tuple[list[dict[str, Any]], int | None]:
    """Rows fetched with ``limit + 1``: the page, and the cursor when there is more."""
    more = len(rows) > limit
    page = rows[:limit]
    return page, (int(page[-1][key]) if more and page else None)


# -- events -----------------------------------------------------------------------------


# Why an answer shows a payload as null (payload_omitted).
PAYLOAD_OMITTED = (
    f"nested deeper than {MAX_PAYLOAD_DEPTH} levels, which this API does not serialize"
    " (stored by SQL; it is sent to the consumers as stored)"
)


def shown_payload(payload: Any) -> dict[str, Any]:
    """An answer's ``payload`` and ``payload_omitted``: a payload a SQL producer stored
    deeper than the API serializes is left out, said why (it failed the whole list, 500)."""
    if payload is TOO_DEEP or payload_too_deep(payload):
        return {"payload": None, "payload_omitted": PAYLOAD_OMITTED}
    return {"payload": payload}


def event_json(row: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "id": int(row["id"]),
        "tenant": _tenant(row["tenant"]),
        "stream_id": row["stream_id"],
        "event_type": row["event_type"],
        **shown_payload(row["payload"]),
        "created_at": _iso(row["created_at"]),
    }


def event_detail_json(row: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`event_json` with the producer's stored trace context (when valid)."""
    return {
        **event_json(row),
        "traceparent": traceparent_header(row["traceparent"]),
        "routing": row["routing"],
    }


# How long an Idempotency-Key of POST /api/v1/events names its request (as Stripe's and the
# IETF draft's keys do): a retry within it gets the first answer, not a second event.
IDEMPOTENCY_TTL_S = 86_400


class _KeyTaken(Exception):
    """A request with the same idempotency key committed first (rolls this one back)."""


def request_hash(tenant: str, stream_id: str, event_type: str, payload: Any) -> str:
    """What an idempotency key is bound to: the request as canonical JSON, hashed."""
    return _sha256(_canonical([tenant, stream_id, event_type, payload]))


# What differs when an event's key names another request.
EVENT_DIFFERS = "its stream_id, event_type or payload differ; use a new key per event"


async def answered_before(
    conn: psycopg.AsyncConnection[Any],
    tenant: str,
    key: str,
    digest: str | Callable[[str], bool] = "",
    differs: str = EVENT_DIFFERS,
) -> dict[str, Any] | None:
    """The first answer to the request ``key`` names, or None (no live key); raises
    :class:`IdempotencyKeyReused` when the key names another request (its ``digest``
    differs, or the kept one is not the request's by ``digest(kept)``; a dashboard form's
    one-time key has none), saying what may differ."""
    found = await _rows(
        conn, "idempotency_find", {"tenant": tenant, "key": key, "ttl_s": IDEMPOTENCY_TTL_S}
    )
    if not found:
        return None
    kept = found[0]["request_hash"]
    if not (digest(kept) if callable(digest) else kept == digest):
        raise IdempotencyKeyReused(
            f"this Idempotency-Key was used in the last {IDEMPOTENCY_TTL_S // 3600} hours"
            f" with another request ({differs})"
        )
    answer: dict[str, Any] = found[0]["response"]
    return answer


async def keep_answer(
    conn: psycopg.AsyncConnection[Any],
    tenant: str,
    key: str,
    answer: dict[str, Any],
    digest: str = "",
) -> bool:
    """Keep ``answer`` under the key, in the caller's transaction; False when another
    request holds the key (it ran at the same moment and committed: roll back)."""
    taken = await _rows(
        conn,
        "idempotency_keep",
        {
            "tenant": tenant,
            "key": key,
            "request_hash": digest,
            "response": Jsonb(answer),
            "ttl_s": IDEMPOTENCY_TTL_S,
        },
    )
    return bool(taken)


# An idempotency key: 1 to 255 visible ASCII characters (a UUID, a hash, the client's id).
IDEMPOTENCY_KEY = r"^[!-~]{1,255}$"
# An endpoint's key is kept apart from an event's of the same tenant and text.
ENDPOINT_KEY_PREFIX = "endpoint:"
ENDPOINT_DIFFERS = "its url, event types or another field differ; use a new key per endpoint"


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


# What endpoints.create makes an endpoint of, with its default: one creation's request,
# whoever sends it (the API's body, `endpoints add`'s options).
CREATION_FIELDS: Mapping[str, Any] = {
    "url": None,
    "event_types": ["*"],
    "secret": None,
    "description": "",
    "headers": {},
    "rate_limit": None,
    "ordered": False,
}


@dataclass(frozen=True)
class EndpointRequest:
    """What an endpoint creation's idempotency key is bound to: its tenant, its fields
    (:data:`CREATION_FIELDS`, with their defaults) and its client certificate. The API and
    `endpoints add` send one creation alike: a key used by both is one request.

    Kept as ``<public>.<secret part>``: the SHA-256 of everything but the values that are
    credentials (the signing secret, the headers' values, the certificate's key), and
    those values apart: by an HMAC under a key derived from the sealing key when secrets
    are sealed (``k<key id>:...``), so that a copy of the keys' table cannot test guesses
    at a weak secret that the endpoints' table keeps sealed; by SHA-256 when they are
    stored in plain anyway (``p:...``)."""

    tenant: str
    fields: Mapping[str, Any]
    client_cert: ClientCert | None

    def _parts(self) -> tuple[str, str]:
        request = {**CREATION_FIELDS, **self.fields}
        headers = dict(request.pop("headers") or {})
        secret = request.pop("secret")
        cert = self.client_cert
        public = {
            **request,
            "secret_given": secret is not None,
            "header_names": sorted(headers),
            "certificate": None if cert is None else _pem_lines(cert.chain),
        }
        private = {
            "secret": secret,
            "header_values": [headers[name] for name in sorted(headers)],
            "certificate_key": None if cert is None else _pem_lines(cert.key),
        }
        return _canonical([self.tenant, public]), _canonical(private)

    def digest(self, keys: Keyring) -> str:
        """The digest to keep: the secret part under ``keys.current`` when it seals."""
        public, private = self._parts()
        return f"{_sha256(public)}.{_secret_part(private, keys.current)}"

    def matches(self, kept: str, keys: Keyring) -> bool:
        """Whether ``kept`` is this request's. Its secret part under a key this process
        does not have cannot be checked: the rest decides."""
        public, private = self._parts()
        kept_public, _, kept_private = kept.partition(".")
        if not hmac.compare_digest(kept_public, _sha256(public)):
            return False
        kind, _, _ = kept_private.partition(":")
        if kind == "p":
            return hmac.compare_digest(kept_private, _secret_part(private, None))
        opening = [k for k in (keys.current, keys.previous) if k is not None and kind == f"k{k.id}"]
        if not opening:
            return kind.startswith("k")  # sealed with a key this process lacks
        return hmac.compare_digest(kept_private, _secret_part(private, opening[0]))


_IDEMPOTENCY_LABEL = b"fluxora-webhooks idempotency key request v1"


def _secret_part(private: str, key: Key | None) -> str:
    if key is None:
        return "p:" + _sha256(private)
    derived = hmac.new(key.material, _IDEMPOTENCY_LABEL, hashlib.sha256).digest()
    mac = hmac.new(derived, private.encode("utf-8", "surrogatepass"), hashlib.sha256)
    return f"k{key.id}:{mac.hexdigest()}"


def _pem_lines(text: str) -> str:
    """PEM text as its lines, whatever the line ends and the blanks around them."""
    return "\n".join(line.strip() for line in text.strip().splitlines() if line.strip())


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


async def create_endpoint_once(
    conn: psycopg.AsyncConnection[Any],
    tenant: str,
    idempotency_key: str,
    request: EndpointRequest,
    create: Callable[[], Awaitable[tuple[Endpoint, str]]],
    *,
    scope: str | None,
    keys: Keyring,
) -> tuple[Endpoint, str | None, bool]:
    """``create()`` at most once per key and tenant within :data:`IDEMPOTENCY_TTL_S`, also
    when two requests arrive at once: returns the endpoint, its secret and whether it was
    created before. A repeated request gets the endpoint as it is now and its secret while
    it is the one created then (opened with ``keys``; None once rotated); an endpoint
    removed since is :class:`NotFoundError`. The key keeps the endpoint's id, a digest of
    its secret as stored (sealed, when it is) and ``request`` as :class:`EndpointRequest`
    keeps it: never the secret, nor a digest of it that a weak secret could be guessed
    from while secrets are sealed (re-sealed since, it is not shown again either)."""
    key = ENDPOINT_KEY_PREFIX + idempotency_key

    def same(kept: str) -> bool:
        return request.matches(kept, keys)

    try:
        async with conn.transaction():
            # Requests with the key one at a time: the next finds the first one's key (a
            # second creation, rolled back on the key, could meet the tenant's cap and
            # answer 409 endpoint_limit instead of the first one's endpoint).
            await conn.execute(query("idempotency_lock"), {"tenant": tenant, "key": key})
            before = await answered_before(conn, tenant, key, same, ENDPOINT_DIFFERS)
            if before is None:
                endpoint, secret = await create()
                stored = _sha256(endpoint.secret or "")
                kept = {"endpoint_id": endpoint.id, "stored_sha256": stored}
                if await keep_answer(conn, tenant, key, kept, request.digest(keys)):
                    return endpoint, secret, False
                raise _KeyTaken
    except _KeyTaken:
        before = await answered_before(conn, tenant, key, same, ENDPOINT_DIFFERS)
        if before is None:  # expired in between: a day-long request, not a case to serve
            raise ConflictError("the Idempotency-Key's request could not be read back") from None
    endpoint = await get_endpoint(conn, str(before["endpoint_id"]), tenant=scope)
    if not endpoint.secret or not hmac.compare_digest(
        _sha256(endpoint.secret), str(before.get("stored_sha256", ""))
    ):
        return endpoint, None, True  # rotated (or re-sealed) since
    try:
        return endpoint, keys.open(endpoint.secret, endpoint.id), True
    except SecretLocked:
        return endpoint, None, True


async def enqueue_event(
    conn: psycopg.AsyncConnection[Any],
    *,
    tenant: str,
    stream_id: str,
    event_type: str,
    payload: Any,
    traceparent: str | None = None,
    tracestate: str | None = None,
    idempotency_key: str | None = None,
) -> tuple[dict[str, Any], bool]:
    """Enqueue an event (as a producer's ``enqueue`` does, in one transaction); returns it
    with its id and ``delivery_id`` -- the built-in default endpoint's (as enqueue returns)
    when the event goes to it (the default tenant's, with that endpoint configured), else
    None: the event row's id would name no delivery -- and whether it is the answer of an
    earlier request. ``traceparent``/``tracestate``: the request's trace context (W3C
    headers), kept with the event so that its attempts join the producer's trace.

    ``idempotency_key``: the same key and request within :data:`IDEMPOTENCY_TTL_S` enqueue
    nothing and return the first request's answer (also when both run at once: the key is
    taken in the event's transaction, and the later one waits for it); the same key with
    another request raises :class:`IdempotencyKeyReused`. Keys are per tenant."""
    check_event_type(event_type)
    digest = ""  # only a key is bound to its request
    if idempotency_key is not None:
        digest = request_hash(tenant, stream_id, event_type, payload)
        kept = await answered_before(conn, tenant, idempotency_key, digest)
        if kept is not None:
            return kept, True
    try:
        async with conn.transaction():
            delivery_id = await enqueue_with_context(
                conn,
                tenant=tenant,
                stream_id=stream_id,
                event_type=event_type,
                payload=payload,
                traceparent=traceparent,
                tracestate=tracestate,
            )
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                "SELECT id, tenant, stream_id, event_type, payload, enqueued_at AS created_at,"
                " tenant = '' AND EXISTS (SELECT 1 FROM webhook_endpoints WHERE id = %s)"
                " AS to_default FROM webhook_outbox WHERE delivery_id = %s::uuid",
                (DEFAULT_ID, delivery_id),
            )
            row = await cur.fetchone()
            assert row is not None
            answer = {
                **event_json(row),
                "delivery_id": delivery_id if row["to_default"] else None,
            }
            if idempotency_key is not None and not await keep_answer(
                conn, tenant, idempotency_key, answer, digest
            ):
                raise _KeyTaken
    except ValueError as exc:
        raise ConfigError("event", str(exc)) from None
    except _KeyTaken:
        assert idempotency_key is not None
        first = await answered_before(conn, tenant, idempotency_key, digest)
        if first is None:  # expired in between: a day-long request, not a case to serve
            raise ConflictError("the Idempotency-Key's request could not be read back") from None
        return first, True
    return answer, False


async def list_events(
    conn: psycopg.AsyncConnection[Any],
    *,
    tenant: str | None = None,
    tenant_filter: str | None = None,
    stream_id: str | None = None,
    event_type: str | None = None,
    limit: int = 100,
    before: int | None = None,
    held: bool = False,
) -> tuple[list[dict[str, Any]], int | None]:
    """The deliveries of the scope that match, newest first, and the cursor of the next
    page. ``held``: only those held by an outage of this service's egress proxy or DNS
    resolver (their ``wait_reason`` says so; ``stats``' ``egress_held`` counts them)."""
    _check_limit(limit)
    rows = await _rows(
        conn,
        "event_list",
        {
            **_scope(tenant),
            "f_tenant": tenant_filter,
            "stream_id": stream_id,
            "event_type": event_type,
            "before": before,
            "limit": limit + 1,
        },
    )
    page, cursor = _page(rows, limit, "id")
    return [event_json(r) for r in page], cursor


async def get_event(
    conn: psycopg.AsyncConnection[Any], event_id: int, *, tenant: str | None = None
) -> dict[str, Any]:
    """The event with its deliveries (one per endpoint it was routed to)."""
    rows = await _rows(conn, "event_get", {"id": event_id, **_scope(tenant)})
    if not rows:
        raise NotFoundError(f"no event {event_id}")
    found, _ = await list_deliveries(conn, tenant=tenant, event_id=event_id, limit=MAX_PAGE)
    return {**event_detail_json(rows[0]), "deliveries": found}


async def event_of_row(
    conn: psycopg.AsyncConnection[Any], delivery_id: str, *, tenant: str | None = None
) -> int | None:
    """The id of the event whose row ``enqueue`` named by ``delivery_id`` (what it returns),
    or None (no such event in the scope, or not an id at all)."""
    try:
        canonical = str(uuid.UUID(delivery_id))  # "urn:uuid:..." and braces too
    except ValueError:
        return None
    rows = await _rows(conn, "event_of_row", {"delivery_id": canonical, **_scope(tenant)})
    return int(rows[0]["id"]) if rows else None


# -- deliveries ---------------------------------------------------------------------------


def delivery_json(row: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "delivery_id": row["delivery_id"],
        "event_id": int(row["event_id"]),
        "endpoint_id": row["endpoint_id"],
        "tenant": _tenant(row["tenant"]),
        "stream_id": row["stream_id"],
        "event_type": row["event_type"],
        "status": row["status"],
        "attempt_count": int(row["attempt_count"]),
        "created_at": _iso(row["created_at"]),
        "last_attempt_at": _iso(row["last_attempt_at"]),
        "next_attempt_at": _iso(row["next_attempt_at"]),
        "seq": int(row["seq"]),
    }


async def list_deliveries(
    conn: psycopg.AsyncConnection[Any],
    *,
    tenant: str | None = None,
    tenant_filter: str | None = None,
    endpoint_id: str | None = None,
    status: str | None = None,
    stream_id: str | None = None,
    event_type: str | None = None,
    event_id: int | None = None,
    limit: int = 100,
    before: int | None = None,
    held: bool = False,
) -> tuple[list[dict[str, Any]], int | None]:
    """The deliveries of the scope that match, newest first, and the cursor of the next
    page. ``held``: only those held by an outage of this service's egress proxy or DNS
    resolver (their ``wait_reason`` says so; ``stats``' ``egress_held`` counts them)."""
    _check_limit(limit)
    if status is not None and status not in STATUSES:
        raise ConfigError("status", f"must be one of {', '.join(STATUSES)}")
    if held and status in ("delivered", "dead_letter", "parked"):
        return [], None  # a held delivery is pending or retrying (not read for nothing)
    rows = await _rows(
        conn,
        "delivery_list",
        {
            **_scope(tenant),
            "f_tenant": tenant_filter,
            "endpoint_id": endpoint_id,
            "status": status,
            "stream_id": stream_id,
            "event_type": event_type,
            "event": event_id,
            "before": before,
            "held": held,
            "held_words": HELD_WORDS,
            "limit": limit + 1,
        },
    )
    page, cursor = _page(rows, limit, "seq")
    return [delivery_json(r) for r in page], cursor


def _valid_uuid(text: str) -> bool:
    try:
        uuid.UUID(text)
    except (ValueError, TypeError, AttributeError):
        return False
    return True


def _status(current: Mapping[str, Any]) -> str:
    if not current["processed"]:
        if current["hold"] == "parked":
            return "parked"
        return "retrying" if current["attempt"] > 1 or current["replay"] else "pending"
    return {"delivered": "delivered", "dead_letter": "dead_letter"}.get(
        current["outcome"], "retrying"
    )


GONE = 410


def _outcome(row: Mapping[str, Any], following: Mapping[str, Any] | None) -> str:
    """An attempt's outcome; ``parked`` for a failed one after which the delivery was
    parked rather than retried: its next row is held parked (its endpoint is disabled, or
    was removed meanwhile), or it got a 410 Gone (recorded as a retry: its endpoint was
    disabled at once, which parks the next attempt)."""
    if row["outcome"] != "retry":
        return str(row["outcome"])
    if row["status_code"] == GONE or (following is not None and following["hold"] == "parked"):
        return "parked"
    return "retry"


async def get_delivery(
    conn: psycopg.AsyncConnection[Any], delivery_id: str, *, tenant: str | None = None
) -> dict[str, Any]:
    """The delivery with its payload and every attempt (time, status code, duration,
    error, response body as kept); a dead-lettered one with its dead letter's reason."""
    if not _valid_uuid(delivery_id):
        raise NotFoundError(f"no delivery {delivery_id[:64]!r}")
    delivery_id = str(uuid.UUID(delivery_id))  # any case, braces or not: the one stored
    params = {"delivery_id": delivery_id, **_scope(tenant)}
    rows = await _rows(conn, "delivery_rows", params)
    if not rows:
        raise NotFoundError(f"no delivery {delivery_id!r}")
    first, current = rows[0], rows[-1]
    attempts = [
        {
            "attempt": int(r["attempt"]),
            "at": _iso(r["processed_at"]),
            "status_code": r["status_code"],
            "duration_ms": r["duration_ms"],
            "error": r["error"],
            "response_body": r["response_body"],
            "outcome": _outcome(r, rows[i + 1] if i + 1 < len(rows) else None),
            "replay": bool(r["replay"]),
        }
        for i, r in enumerate(rows)
        if r["attempted"]  # delivery_rows: a row with no request is none
    ]
    status = _status(current)
    reason = None
    if status == "dead_letter":
        found = await _rows(conn, "delivery_dead_reason", params)
        reason = found[0]["reason"] if found else None
    return {
        "delivery_id": first["delivery_id"],
        "event_id": int(first["event_id"]),
        "endpoint_id": first["endpoint_id"],
        "tenant": _tenant(first["tenant"]),
        "stream_id": first["stream_id"],
        "event_type": first["event_type"],
        "status": status,
        "dead_letter_reason": reason,
        # A pending row's error is what holds it (complete_held), never an attempt's; a
        # parked one waits for its endpoint, whatever held it before (its status says so).
        "wait_reason": _wait_reason(current, status),
        "attempt_count": len(attempts),
        "created_at": _iso(first["enqueued_at"]),
        "last_attempt_at": attempts[-1]["at"] if attempts else None,
        "next_attempt_at": None if current["processed"] else _iso(current["due_at"]),
        **shown_payload(first["payload"]),
        "attempts": attempts,
        "trace_id": delivery_trace_id(first["delivery_id"], current["traceparent"]),
    }


# What a delivery of an ordered endpoint that is not its stream's head waits for.
STREAM_WAIT = (
    "waiting for the earlier events of its stream (its endpoint is ordered): it is sent once"
    " the one before it is delivered or ends"
)


def _wait_reason(current: Mapping[str, Any], status: str) -> str | None:
    """Why a pending delivery is held with no attempt used: an outage of this service's
    way out (its row's error, complete_held's words) or its stream's earlier events; None
    for any other (a parked one's status says why)."""
    if current["processed"] or status == "parked":
        return None
    if current["hold"] == "waiting":
        return STREAM_WAIT
    error: str | None = current["error"]
    return error


async def replay(
    conn: psycopg.AsyncConnection[Any], delivery_id: str, *, tenant: str | None = None
) -> dict[str, Any]:
    """Send the delivery again under its delivery id, whatever its status: a pending one
    is due now (a parked one stays parked until its endpoint is enabled; an ordered
    stream's waiting one keeps its place), a finished one (delivered or dead-lettered) gets
    a new attempt, and its dead letter is marked replayed. Returns the delivery."""
    if not _valid_uuid(delivery_id):
        raise NotFoundError(f"no delivery {delivery_id[:64]!r}")
    # The one stored: the advisory lock is taken on this text, whatever case was asked.
    delivery_id = str(uuid.UUID(delivery_id))
    params = {"delivery_id": delivery_id, **_scope(tenant)}
    async with conn.transaction():
        await conn.execute(f"SET LOCAL lock_timeout = '{REPLAY_LOCK_TIMEOUT}'")
        await conn.execute(query("delivery_lock"), params)
        current = await _current_locked(conn, params)
        if current["endpoint_state"] is None:
            raise ConflictError(f"the endpoint of {delivery_id} was removed; it cannot be sent")
        pairs: list[tuple[str, str]] = []
        if not current["processed"]:
            if current["hold"] is None and current["lease"] is None and current["later"]:
                await conn.execute(query("delivery_due_now"), {"id": current["id"]})
            if current["hold"] == "waiting":
                pairs.append((current["endpoint_id"], current["stream_id"]))
        else:
            rows = await _rows(conn, "delivery_requeue", {"id": current["id"]})
            pairs = [(current["endpoint_id"], r["stream_id"]) for r in rows if r["stream_seq"]]
    # After the commit: no transaction waits for a stream's lock holding anything else
    # (docs/design.md, "Ordering"); should this fail, the sweep chooses the head.
    await promote_after_commit(conn, pairs)
    return await get_delivery(conn, delivery_id, tenant=tenant)


async def _current_locked(
    conn: psycopg.AsyncConnection[Any], params: Mapping[str, Any]
) -> dict[str, Any]:
    """The current row, locked; read again when a batch that held it added a newer one."""
    seen: int | None = None
    for _ in range(5):
        try:
            rows = await _rows(conn, "delivery_current_for_update", params)
        except psycopg.errors.LockNotAvailable:
            raise ConflictError("the delivery is being sent right now; try again") from None
        if not rows:
            raise NotFoundError(f"no delivery {params['delivery_id']!r}")
        if rows[0]["id"] == seen:
            return rows[0]
        seen = rows[0]["id"]
    return rows[0]


# -- statistics ---------------------------------------------------------------------------


def _ms(value: Any) -> float | None:
    return None if value is None else round(float(value), 2)


def check_window(window_ms: int) -> int:
    if not 60_000 <= window_ms <= MAX_WINDOW_MS:
        raise ConfigError("window", "must be from 1m to 7d")
    return window_ms


async def stats(
    conn: psycopg.AsyncConnection[Any],
    *,
    tenant: str | None = None,
    window_ms: int = 3_600_000,
    endpoints_limit: int = MAX_PAGE,
    endpoints_after: str | None = None,
) -> dict[str, Any]:
    """Backlog, dead letters, recent outcomes and per-endpoint health of the scope (breaker
    states are added by :func:`breaker_states`, which needs Redis). The endpoints are a
    page by id (``endpoints_after``: the last id of the previous page); ``endpoints_after``
    in the answer is the next page's, None when this page is the last. Dead letters
    ``waiting`` are those a replay or a recovery can send; ``of_removed_endpoints`` those
    whose endpoint was removed, which only a purge settles."""
    check_window(window_ms)
    _check_limit(endpoints_limit)
    scope = _scope(tenant)
    backlog = (
        await _rows(conn, "stats_backlog", {**scope, "cap": STATS_COUNT_CAP, "held": HELD_WORDS})
    )[0]
    outcomes = await _rows(conn, "stats_outcomes", {**scope, "window_ms": window_ms})
    health = await _health_rows(
        conn, scope, window_ms, limit=endpoints_limit + 1, after=endpoints_after
    )
    shown = health[:endpoints_limit]
    by_outcome = {r["outcome"]: r for r in outcomes}
    return {
        "window_seconds": window_ms // 1000,
        "backlog": {
            "pending": int(backlog["pending"]),
            "due": int(backlog["due"]),
            "parked": int(backlog["parked"]),
            "egress_held": int(backlog["egress_held"]),
            "oldest_due_age_seconds": round(max(0.0, float(backlog["oldest_due_age_s"] or 0)), 3),
            "capped_at": STATS_COUNT_CAP,
        },
        "dead_letters": {
            "waiting": int(backlog["dead_letters"]),
            "of_removed_endpoints": int(backlog["dead_letters_of_removed"]),
        },
        "recent": {
            o: {
                "attempts": int(by_outcome[o]["attempts"]) if o in by_outcome else 0,
                "p50_ms": _ms(by_outcome[o]["p50_ms"]) if o in by_outcome else None,
                "p95_ms": _ms(by_outcome[o]["p95_ms"]) if o in by_outcome else None,
            }
            for o in ("delivered", "retry", "dead_letter")
        },
        "endpoints": [_health(r) for r in shown],
        "endpoints_after": shown[-1]["id"] if len(health) > endpoints_limit and shown else None,
    }


async def endpoint_health(
    conn: psycopg.AsyncConnection[Any],
    ids: Sequence[str],
    *,
    tenant: str | None = None,
    window_ms: int = 3_600_000,
) -> list[dict[str, Any]]:
    """The health of these endpoints (those of the scope), as :func:`stats` gives it: for
    a page of endpoints, or one, wherever it is in the list."""
    check_window(window_ms)
    wanted = sorted(set(ids))
    if not wanted:
        return []
    rows = await _health_rows(conn, _scope(tenant), window_ms, limit=len(wanted), ids=wanted)
    return [_health(r) for r in rows]


async def _health_rows(
    conn: psycopg.AsyncConnection[Any],
    scope: Mapping[str, Any],
    window_ms: int,
    *,
    limit: int,
    after: str | None = None,
    ids: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    params = {
        **scope,
        "window_ms": window_ms,
        "cap": STATS_COUNT_CAP,
        "limit": limit,
        "after": after,
        "ids": None if ids is None else list(ids),
    }
    return await _rows(conn, "stats_endpoints", params)


def _health(row: Mapping[str, Any]) -> dict[str, Any]:
    attempts = int(row["attempts"])
    return {
        "id": row["id"],
        "tenant": _tenant(row["tenant"]),
        "state": row["state"],
        "disabled_reason": row["disabled_reason"],
        "attempts": attempts,
        "success_rate": round(int(row["delivered"]) / attempts, 4) if attempts else None,
        "p50_ms": _ms(row["p50_ms"]),
        "p95_ms": _ms(row["p95_ms"]),
        "pending": int(row["pending"]),
        "breaker": None,
        "url": row["url"],  # for the breaker lookup; removed before it is shown
    }


async def series(
    conn: psycopg.AsyncConnection[Any],
    *,
    tenant: str | None = None,
    window_ms: int = 3_600_000,
    buckets: int = 30,
) -> list[dict[str, Any]]:
    """The window in ``buckets`` equal parts: attempts by outcome, enqueue-to-delivery
    latency (p50, p95), the backlog at each part's end and the dead letters."""
    check_window(window_ms)
    if not 2 <= buckets <= 200:
        raise ConfigError("buckets", "must be from 2 to 200")
    rows = await _rows(
        conn, "stats_series", {**_scope(tenant), "window_ms": window_ms, "buckets": buckets}
    )
    return [
        {
            "at": _iso(r["at"]),
            "delivered": int(r["delivered"]),
            "retry": int(r["retry"]),
            "dead_letter": int(r["dead_letter"]),
            "latency_p50_ms": _ms(r["p50_ms"]),
            "latency_p95_ms": _ms(r["p95_ms"]),
            "backlog": max(0, int(r["backlog"] or 0)),
            "dead_letters": int(r["dead_letters"]),
        }
        for r in rows
    ]


async def breaker_states(
    redis_url: str | None, prefix: str, urls: Sequence[str], timeout_s: float = 2.0
) -> tuple[dict[str, dict[str, Any]], str | None]:
    """Each URL's shared circuit breaker from Redis: ({url: state}, None), or ({}, why)
    when Redis is not configured or cannot be read (shown, never an error). An open
    breaker whose time is up is half-open: its next request is the probe (the stored
    state changes only then, and never while no dispatcher sends to it)."""
    if not redis_url:
        return {}, "REDIS_URL is not set"
    if not urls:
        return {}, None
    from .logs import scrub
    from .redis_connect import client_for
    from .redis_gate import HALF_OPEN, OPEN, read_breaker_state

    client = client_for(
        redis_url, socket_connect_timeout=timeout_s / 2, socket_timeout=timeout_s / 2
    )
    unique = sorted(set(urls))
    try:
        async with asyncio.timeout(timeout_s):
            found = await asyncio.gather(*(read_breaker_state(client, u, prefix) for u in unique))
    except Exception as exc:  # unreachable, auth, timeout: say so
        text = scrub(str(exc)).strip()
        return {}, f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    finally:
        await client.aclose()
    now_ms = int(time.time() * 1000)  # this host's clock: a reading, not a decision
    return {
        url: {
            "state": HALF_OPEN if s.state == OPEN and s.reset_at_ms <= now_ms else s.state,
            "failures": s.failures,
        }
        for url, s in zip(unique, found, strict=True)
    }, None
