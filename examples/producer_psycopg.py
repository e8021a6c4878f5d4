"""Enqueue webhook events from psycopg code, in the transaction of the business write.

    DATABASE_URL=postgresql://app@localhost/app python examples/producer_psycopg.py

The rule of the transactional outbox: the stream update and its event commit together or
not at all. ``enqueue`` writes the event on *your* connection, inside *your* transaction,
so a rollback (an exception, a failed constraint, a crash before COMMIT) sends nothing,
and a commit can no longer lose the event: the dispatcher delivers it at least once.

Run ``fluxora-webhooks migrate`` once on the database first (it creates ``webhook_outbox``).
The ``streams`` table below stands for your own tables.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from fluxora_webhooks import enqueue

STREAMS_TABLE = """
CREATE TABLE IF NOT EXISTS streams (
    id              text PRIMARY KEY,
    sender          text NOT NULL,
    recipient       text NOT NULL,
    rate_per_second bigint NOT NULL,
    status          text NOT NULL DEFAULT 'active',
    updated_at      timestamptz NOT NULL DEFAULT now()
)
"""

_COLUMNS = "id, sender, recipient, rate_per_second, status, updated_at"


class StreamNotActive(LookupError):
    """No active stream with this id: nothing was written, nothing will be sent."""


def _payload(row: tuple[Any, ...]) -> dict[str, Any]:
    """The event body: plain JSON types only (a datetime becomes ISO text)."""
    stream_id, sender, recipient, rate, status, updated_at = row
    return {
        "id": stream_id,
        "sender": sender,
        "recipient": recipient,
        "rate_per_second": rate,
        "status": status,
        "updated_at": updated_at.isoformat(),
    }


def create_stream(
    conn: psycopg.Connection[Any], stream_id: str, sender: str, recipient: str, rate: int
) -> str:
    """Create a stream and enqueue ``stream.created``; returns the event's delivery id."""
    with conn.transaction():
        row = conn.execute(
            "INSERT INTO streams (id, sender, recipient, rate_per_second)"
            f" VALUES (%s, %s, %s, %s) RETURNING {_COLUMNS}",
            (stream_id, sender, recipient, rate),
        ).fetchone()
        assert row is not None
        return enqueue(
            conn, stream_id=stream_id, event_type="stream.created", payload=_payload(row)
        )


def pause_stream(conn: psycopg.Connection[Any], stream_id: str) -> str:
    """Pause a stream and enqueue ``stream.paused`` in one transaction.

    ``conn.transaction()`` commits on leaving the block, or, when the caller already has a
    transaction open, becomes a savepoint in it: then the caller's COMMIT or ROLLBACK
    decides for the stream update and the event together.
    """
    with conn.transaction():
        row = conn.execute(
            "UPDATE streams SET status = 'paused', updated_at = now()"
            f" WHERE id = %s AND status = 'active' RETURNING {_COLUMNS}",
            (stream_id,),
        ).fetchone()
        if row is None:
            raise StreamNotActive(stream_id)  # raised inside the block: rolled back
        return enqueue(conn, stream_id=stream_id, event_type="stream.paused", payload=_payload(row))


async def pause_stream_async(conn: psycopg.AsyncConnection[Any], stream_id: str) -> str:
    """The same with an async connection: ``enqueue`` is awaited."""
    async with conn.transaction():
        cur = await conn.execute(
            "UPDATE streams SET status = 'paused', updated_at = now()"
            f" WHERE id = %s AND status = 'active' RETURNING {_COLUMNS}",
            (stream_id,),
        )
        row = await cur.fetchone()
        if row is None:
            raise StreamNotActive(stream_id)
        return await enqueue(
            conn, stream_id=stream_id, event_type="stream.paused", payload=_payload(row)
        )


def cancel_stream_plain_sql(conn: psycopg.Connection[Any], stream_id: str) -> str:
    """Without the library: the outbox INSERT is the contract, usable from any language."""
    with conn.transaction():
        row = conn.execute(
            "UPDATE streams SET status = 'cancelled', updated_at = now()"
            f" WHERE id = %s AND status <> 'cancelled' RETURNING {_COLUMNS}",
            (stream_id,),
        ).fetchone()
        if row is None:
            raise StreamNotActive(stream_id)
        created = conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload)"
            " VALUES (%s, %s, %s) RETURNING delivery_id::text",
            (stream_id, "stream.cancelled", Jsonb(_payload(row))),
        ).fetchone()
        assert created is not None
        return str(created[0])


async def main_async(database_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        await conn.execute(
            "INSERT INTO streams (id, sender, recipient, rate_per_second)"
            " VALUES ('example-async', 'alice', 'bob', 7) ON CONFLICT (id) DO UPDATE"
            " SET status = 'active'"
        )
        await conn.commit()
        delivery_id = await pause_stream_async(conn, "example-async")
        print(f"stream.paused (async) enqueued: delivery id {delivery_id}")


def main() -> None:
    database_url = os.environ["DATABASE_URL"]
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(STREAMS_TABLE)
        conn.execute("DELETE FROM streams WHERE id LIKE 'example-%'")
        print("stream.created enqueued:", create_stream(conn, "example-1", "alice", "bob", 42))
        print("stream.paused enqueued:", pause_stream(conn, "example-1"))
        try:
            pause_stream(conn, "example-1")  # already paused
        except StreamNotActive:
            print("pausing it again failed: nothing written, nothing enqueued")
        print("stream.cancelled enqueued:", cancel_stream_plain_sql(conn, "example-1"))
    asyncio.run(main_async(database_url))


if __name__ == "__main__":
    main()
