"""The outbox: enqueue (producer side) and the dispatcher's claim and completion queries."""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, overload

import psycopg
from psycopg.types.json import Jsonb

from .queries import query

NOTIFY_CHANNEL = "webhook_outbox"


class Outcome(StrEnum):
    """What an attempt (or a decision not to attempt) did to a claimed row.

    The first three are recorded on the row (``webhook_outbox.outcome``); a deferral only
    moves the row's due time and consumes no attempt.
    """

    DELIVERED = "delivered"
    RETRY = "retry"
    DEAD_LETTER = "dead_letter"
    DEFERRED = "deferred"


def _check_names(stream_id: str, event_type: str) -> None:
    if not isinstance(stream_id, str) or not stream_id:
        raise ValueError("stream_id must be a non-empty string")
    if not isinstance(event_type, str) or not event_type:
        raise ValueError("event_type must be a non-empty string")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in event_type) or not event_type.isascii():
        raise ValueError("event_type must be printable ASCII (it is sent as a header)")


@overload
def enqueue(
    conn: psycopg.Connection[Any], *, stream_id: str, event_type: str, payload: Any
) -> str: ...


@overload
def enqueue(
    conn: psycopg.AsyncConnection[Any], *, stream_id: str, event_type: str, payload: Any
) -> Awaitable[str]: ...


def enqueue(
    conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any],
    *,
    stream_id: str,
    event_type: str,
    payload: Any,
) -> str | Awaitable[str]:
    """Write one event into the outbox on the caller's connection, in the caller's
    transaction, and return its delivery id.

    Nothing is sent unless that transaction commits. With an async connection, await it::

        with conn.transaction():
            conn.execute("UPDATE streams ...")
            enqueue(conn, stream_id="s1", event_type="stream.updated", payload={...})
    """
    _check_names(stream_id, event_type)
    params = {"stream_id": stream_id, "event_type": event_type, "payload": Jsonb(payload)}
    if isinstance(conn, psycopg.AsyncConnection):
        return _enqueue_async(conn, params)
    row = conn.execute(query("enqueue"), params).fetchone()
    assert row is not None
    return str(row[0])


async def _enqueue_async(conn: psycopg.AsyncConnection[Any], params: dict[str, Any]) -> str:
    cur = await conn.execute(query("enqueue"), params)
    row = await cur.fetchone()
    assert row is not None
    return str(row[0])


@dataclass(frozen=True, slots=True)
class Claimed:
    """A claimed outbox row, ready to send."""

    id: int
    delivery_id: str
    event_type: str
    body: bytes
    attempt: int
    replay: bool = False
    # Unix seconds on the database's clock at the claim: the signed x-fluxora-timestamp
    # and webhook-timestamp (a dispatcher whose clock is off must not sign stale times).
    timestamp: int = 0

    @property
    def is_retry(self) -> bool:
        """Gated as a retry: a later attempt, or a replayed dead letter."""
        return self.attempt > 1 or self.replay


@dataclass(frozen=True, slots=True)
class Completion:
    """What to write for one claimed row.

    ``delay_ms`` is the delay (from the database's clock) of the retry row or the deferral.
    """

    id: int
    outcome: Outcome
    delay_ms: int = 0
    status_code: int | None = None
    error: str | None = None
    response_body: str | None = None
    duration_ms: float | None = None
    reason: str | None = None


async def claim_due(conn: psycopg.AsyncConnection[Any], batch: int) -> list[Claimed]:
    """Lock up to ``batch`` due rows (``FOR UPDATE SKIP LOCKED``) in the open transaction."""
    cur = await conn.execute(query("claim_due"), {"batch": batch})
    return [
        Claimed(int(r[0]), r[1], r[2], r[3].encode("utf-8"), int(r[4]), bool(r[5]), int(r[6]))
        for r in await cur.fetchall()
    ]


async def next_due_in_ms(conn: psycopg.AsyncConnection[Any]) -> int | None:
    """Milliseconds until the earliest pending row is due, None when nothing is pending."""
    cur = await conn.execute(query("next_due_in_ms"))
    row = await cur.fetchone()
    return None if row is None or row[0] is None else max(0, int(row[0]))


async def relock_claimed(conn: psycopg.AsyncConnection[Any], ids: Sequence[int]) -> set[int]:
    """Lock again, after a rolled-back batch, those of ``ids`` still unprocessed and not
    held by another transaction; returns their ids."""
    cur = await conn.execute(query("relock_claimed"), {"ids": list(ids)})
    return {int(row[0]) for row in await cur.fetchall()}


async def complete(
    conn: psycopg.AsyncConnection[Any], completions: Sequence[Completion]
) -> tuple[int, int, int, int]:
    """Write every outcome of a batch in one statement.

    Returns (processed, deferred, retries inserted, dead letters inserted).
    """
    cur = await conn.execute(
        query("complete_batch"),
        {
            "ids": [c.id for c in completions],
            "outcomes": [c.outcome for c in completions],
            "delays": [c.delay_ms for c in completions],
            "codes": [c.status_code for c in completions],
            "errors": [c.error for c in completions],
            "bodies": [c.response_body for c in completions],
            "durations": [c.duration_ms for c in completions],
            "reasons": [c.reason for c in completions],
        },
    )
    row = await cur.fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2]), int(row[3])
