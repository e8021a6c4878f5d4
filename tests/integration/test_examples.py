"""The producer examples under examples/: a commit leaves the event in the outbox with the
right payload, a rollback leaves nothing, and the scripts run as they are."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import psycopg
import pytest

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclass and ORM machinery look modules up by name
    spec.loader.exec_module(module)
    return module


pg_example = load("producer_psycopg")
sa_example = load("producer_sqlalchemy")


class Boom(Exception):
    """A failure after the enqueue, in the caller's transaction."""


def outbox(conn: psycopg.Connection[Any], stream_id: str) -> list[tuple[str, str, Any]]:
    return [
        (str(r[0]), str(r[1]), r[2])
        for r in conn.execute(
            "SELECT delivery_id::text, event_type, payload FROM webhook_outbox"
            " WHERE stream_id = %s ORDER BY id",
            (stream_id,),
        ).fetchall()
    ]


def status(conn: psycopg.Connection[Any], stream_id: str) -> str | None:
    row = conn.execute("SELECT status FROM streams WHERE id = %s", (stream_id,)).fetchone()
    return None if row is None else str(row[0])


@pytest.fixture
def conn(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(database_url, autocommit=True) as connection:
        connection.execute(pg_example.STREAMS_TABLE)
        yield connection


# -- psycopg ---------------------------------------------------------------------------


def test_psycopg_commit_enqueues_with_the_payload(conn: psycopg.Connection[Any]) -> None:
    created = pg_example.create_stream(conn, "s-1", "alice", "bob", 42)
    paused = pg_example.pause_stream(conn, "s-1")
    events = outbox(conn, "s-1")
    assert [(d, e) for d, e, _ in events] == [
        (created, "stream.created"),
        (paused, "stream.paused"),
    ]
    payload = events[1][2]
    assert payload["id"] == "s-1"
    assert payload["status"] == "paused"
    assert payload["rate_per_second"] == 42
    assert (payload["sender"], payload["recipient"]) == ("alice", "bob")
    assert status(conn, "s-1") == "paused"


def test_psycopg_failed_write_enqueues_nothing(conn: psycopg.Connection[Any]) -> None:
    pg_example.create_stream(conn, "s-1", "alice", "bob", 42)
    pg_example.pause_stream(conn, "s-1")
    with pytest.raises(pg_example.StreamNotActive):
        pg_example.pause_stream(conn, "s-1")  # already paused
    assert [e for _, e, _ in outbox(conn, "s-1")] == ["stream.created", "stream.paused"]


def test_psycopg_caller_rollback_undoes_write_and_event(conn: psycopg.Connection[Any]) -> None:
    pg_example.create_stream(conn, "s-1", "alice", "bob", 42)
    with pytest.raises(Boom), conn.transaction():
        pg_example.pause_stream(conn, "s-1")  # a savepoint in the caller's transaction
        raise Boom
    assert status(conn, "s-1") == "active"
    assert [e for _, e, _ in outbox(conn, "s-1")] == ["stream.created"]


def test_psycopg_without_autocommit(database_url: str, conn: psycopg.Connection[Any]) -> None:
    pg_example.create_stream(conn, "s-1", "alice", "bob", 42)
    with psycopg.connect(database_url) as other:  # psycopg's default: autocommit off
        other.execute("SELECT 1")  # a transaction is open now
        pg_example.pause_stream(other, "s-1")
        other.rollback()
        assert outbox(conn, "s-1")[-1][1] == "stream.created"
        pg_example.pause_stream(other, "s-1")
        other.commit()
    assert outbox(conn, "s-1")[-1][1] == "stream.paused"


async def test_psycopg_async_commit_and_rollback(
    database_url: str, conn: psycopg.Connection[Any]
) -> None:
    pg_example.create_stream(conn, "s-1", "alice", "bob", 42)
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as aconn:
        with pytest.raises(Boom):
            async with aconn.transaction():
                await pg_example.pause_stream_async(aconn, "s-1")
                raise Boom
        assert [e for _, e, _ in outbox(conn, "s-1")] == ["stream.created"]
        delivery_id = await pg_example.pause_stream_async(aconn, "s-1")
    assert outbox(conn, "s-1")[-1][:2] == (delivery_id, "stream.paused")
    assert outbox(conn, "s-1")[-1][2]["status"] == "paused"


def test_plain_sql_producer(conn: psycopg.Connection[Any]) -> None:
    pg_example.create_stream(conn, "s-1", "alice", "bob", 42)
    with pytest.raises(Boom), conn.transaction():
        pg_example.cancel_stream_plain_sql(conn, "s-1")
        raise Boom
    assert status(conn, "s-1") == "active"
    delivery_id = pg_example.cancel_stream_plain_sql(conn, "s-1")
    assert outbox(conn, "s-1")[-1][:2] == (delivery_id, "stream.cancelled")
    assert outbox(conn, "s-1")[-1][2]["status"] == "cancelled"


# -- SQLAlchemy ------------------------------------------------------------------------


@pytest.fixture
def engine(database_url: str) -> Iterator[Any]:
    engine = sa_example.make_engine(database_url)
    sa_example.Base.metadata.create_all(engine)
    try:
        yield engine
    finally:
        engine.dispose()


def test_sqlalchemy_commit_enqueues_with_the_payload(
    engine: Any, conn: psycopg.Connection[Any]
) -> None:
    from sqlalchemy.orm import Session

    with Session(engine) as session, session.begin():
        created = sa_example.create_stream(session, "s-1", "alice", "bob", 42)
    with Session(engine) as session, session.begin():
        paused = sa_example.pause_stream(session, "s-1")
    events = outbox(conn, "s-1")
    assert [(d, e) for d, e, _ in events] == [
        (created, "stream.created"),
        (paused, "stream.paused"),
    ]
    assert events[0][2]["status"] == "active"
    assert events[1][2]["status"] == "paused"
    assert events[1][2]["rate_per_second"] == 42
    assert status(conn, "s-1") == "paused"


def test_sqlalchemy_rollback_enqueues_nothing(engine: Any, conn: psycopg.Connection[Any]) -> None:
    from sqlalchemy.orm import Session

    with Session(engine) as session, session.begin():
        sa_example.create_stream(session, "s-1", "alice", "bob", 42)
    with pytest.raises(Boom), Session(engine) as session, session.begin():
        sa_example.pause_stream(session, "s-1")
        raise Boom
    assert status(conn, "s-1") == "active"
    assert [e for _, e, _ in outbox(conn, "s-1")] == ["stream.created"]


def test_sqlalchemy_with_the_library_enqueue_on_the_driver_connection(
    engine: Any, conn: psycopg.Connection[Any]
) -> None:
    from sqlalchemy.orm import Session

    with Session(engine) as session, session.begin():
        sa_example.create_stream(session, "s-1", "alice", "bob", 42)
    with pytest.raises(Boom), Session(engine) as session, session.begin():
        sa_example.cancel_stream(session, "s-1")
        raise Boom
    assert status(conn, "s-1") == "active"
    assert [e for _, e, _ in outbox(conn, "s-1")] == ["stream.created"]

    with Session(engine) as session, session.begin():
        delivery_id = sa_example.cancel_stream(session, "s-1")
    assert outbox(conn, "s-1")[-1][:2] == (delivery_id, "stream.cancelled")
    assert outbox(conn, "s-1")[-1][2]["status"] == "cancelled"
    assert status(conn, "s-1") == "cancelled"


def test_sqlalchemy_url() -> None:
    assert sa_example.sqlalchemy_url("postgresql://u@h/db") == "postgresql+psycopg://u@h/db"
    assert sa_example.sqlalchemy_url("postgres://u@h/db") == "postgresql+psycopg://u@h/db"
    assert sa_example.sqlalchemy_url("postgresql+psycopg://u@h/db") == (
        "postgresql+psycopg://u@h/db"
    )


# -- the scripts as a user runs them ---------------------------------------------------


@pytest.mark.parametrize("script", ["producer_psycopg.py", "producer_sqlalchemy.py"])
def test_example_script_runs(script: str, database_url: str, conn: psycopg.Connection[Any]) -> None:
    env = {**os.environ, "DATABASE_URL": database_url}
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "stream.cancelled enqueued" in result.stdout
    assert "nothing written, nothing enqueued" in result.stdout
    events = [e for _, e, _ in outbox(conn, "example-1")]
    assert events == ["stream.created", "stream.paused", "stream.cancelled"]
