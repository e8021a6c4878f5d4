"""Enqueue webhook events from SQLAlchemy 2.0 code, in the session's transaction.

    DATABASE_URL=postgresql://app@localhost/app python examples/producer_sqlalchemy.py

The business write goes through the ORM (or Core), the outbox INSERT through
``session.execute``: both run on the session's connection, in its transaction, so they
commit together when the session commits and vanish together when it rolls back.

Use the psycopg 3 driver (``postgresql+psycopg://...``). Run ``fluxora-webhooks migrate``
once on the database first (it creates ``webhook_outbox``).
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any

import psycopg
from sqlalchemy import BigInteger, DateTime, Engine, String, create_engine, func, text
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from fluxora_webhooks import enqueue


class Base(DeclarativeBase):
    pass


class Stream(Base):
    """Stands for your own model."""

    __tablename__ = "streams"

    id: Mapped[str] = mapped_column(String, primary_key=True)
    sender: Mapped[str] = mapped_column(String)
    recipient: Mapped[str] = mapped_column(String)
    rate_per_second: Mapped[int] = mapped_column(BigInteger)
    status: Mapped[str] = mapped_column(String, default="active")
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now(), onupdate=func.now()
    )

    def as_event(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "sender": self.sender,
            "recipient": self.recipient,
            "rate_per_second": self.rate_per_second,
            "status": self.status,
            "updated_at": self.updated_at.isoformat(),
        }


class StreamNotActive(LookupError):
    """No active stream with this id."""


# The outbox contract in plain SQL; the payload goes in as JSON text.
ENQUEUE = text(
    "INSERT INTO webhook_outbox (stream_id, event_type, payload)"
    " VALUES (:s, :e, CAST(:p AS jsonb)) RETURNING delivery_id::text"
)


def enqueue_event(session: Session, stream_id: str, event_type: str, payload: Any) -> str:
    """Add an event to the session's transaction; returns its delivery id."""
    result = session.execute(ENQUEUE, {"s": stream_id, "e": event_type, "p": json.dumps(payload)})
    return str(result.scalar_one())


def sqlalchemy_url(database_url: str) -> str:
    """``postgresql://...`` -> ``postgresql+psycopg://...`` (SQLAlchemy's psycopg 3 driver)."""
    scheme, sep, rest = database_url.partition("://")
    if scheme in ("postgres", "postgresql") and sep:
        return f"postgresql+psycopg://{rest}"
    return database_url


def create_stream(session: Session, stream_id: str, sender: str, recipient: str, rate: int) -> str:
    """Create a stream (ORM) and enqueue ``stream.created``. The caller commits."""
    stream = Stream(id=stream_id, sender=sender, recipient=recipient, rate_per_second=rate)
    session.add(stream)
    session.flush()  # INSERT now, so that the server's defaults (updated_at) can be read
    return enqueue_event(session, stream.id, "stream.created", stream.as_event())


def pause_stream(session: Session, stream_id: str) -> str:
    """Pause a stream (ORM) and enqueue ``stream.paused``. The caller commits::

    with Session(engine) as session, session.begin():
        pause_stream(session, "s-42")
    """
    stream = session.get(Stream, stream_id, with_for_update=True)
    if stream is None or stream.status != "active":
        raise StreamNotActive(stream_id)
    stream.status = "paused"
    session.flush()  # the UPDATE, in this transaction
    return enqueue_event(session, stream.id, "stream.paused", stream.as_event())


def cancel_stream(session: Session, stream_id: str) -> str:
    """The same with ``fluxora_webhooks``' own ``enqueue``, called on the psycopg connection
    under the session: it is the connection of the session's transaction."""
    stream = session.get(Stream, stream_id, with_for_update=True)
    if stream is None or stream.status == "cancelled":
        raise StreamNotActive(stream_id)
    stream.status = "cancelled"
    session.flush()
    psycopg_conn = session.connection().connection.driver_connection
    assert isinstance(psycopg_conn, psycopg.Connection), "use the postgresql+psycopg driver"
    return enqueue(
        psycopg_conn, stream_id=stream.id, event_type="stream.cancelled", payload=stream.as_event()
    )


def make_engine(database_url: str) -> Engine:
    return create_engine(sqlalchemy_url(database_url))


def main() -> None:
    engine = make_engine(os.environ["DATABASE_URL"])
    Base.metadata.create_all(engine)
    with Session(engine) as session, session.begin():
        session.execute(text("DELETE FROM streams WHERE id LIKE 'example-%'"))
    with Session(engine) as session, session.begin():
        print("stream.created enqueued:", create_stream(session, "example-1", "alice", "bob", 42))
    with Session(engine) as session, session.begin():
        print("stream.paused enqueued:", pause_stream(session, "example-1"))
    try:
        with Session(engine) as session, session.begin():
            pause_stream(session, "example-1")  # already paused: raises, rolls back
    except StreamNotActive:
        print("pausing it again failed: nothing written, nothing enqueued")
    with Session(engine) as session, session.begin():
        print("stream.cancelled enqueued:", cancel_stream(session, "example-1"))
    engine.dispose()


if __name__ == "__main__":
    main()
