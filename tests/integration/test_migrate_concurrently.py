"""A migration marked ``-- fluxora: concurrently`` builds its indexes without holding off
the producers' INSERTs; a run interrupted half-way (an INVALID index left behind) is
completed by the next ``migrate``; and a partitioned outbox gets the indexes on every
partition."""

from __future__ import annotations

import asyncio
import re
import secrets
from typing import Any

import psycopg
import pytest

from fluxora_webhooks import migrations, partitions

pytestmark = pytest.mark.integration

CONCURRENT = [m for m in migrations.available() if m.concurrently]


def _indexes(migration: migrations.Migration) -> list[tuple[str, str]]:
    """(index, table) of each index the migration builds."""
    return re.findall(r"IF NOT EXISTS (\w+)\s+ON (\w+)", migration.sql)


async def _forget(conn: psycopg.AsyncConnection[Any], migration: migrations.Migration) -> None:
    """The database as before the migration: its indexes dropped, its record removed."""
    for name, _ in _indexes(migration):
        await conn.execute(f"DROP INDEX IF EXISTS {name}")
    await conn.execute(
        "DELETE FROM fluxora_schema_migrations WHERE version = %s", (migration.version,)
    )


async def _valid(conn: psycopg.AsyncConnection[Any], name: str) -> bool | None:
    cur = await conn.execute(
        "SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass(%s)", (name,)
    )
    row = await cur.fetchone()
    return None if row is None else bool(row[0])


def test_the_read_indexes_migration_is_concurrent() -> None:
    assert [m.name for m in CONCURRENT] == ["api_read_indexes"]
    for statement in CONCURRENT[0].statements():
        assert statement.startswith("CREATE INDEX CONCURRENTLY IF NOT EXISTS"), statement


async def test_an_interrupted_build_is_completed_by_the_next_migrate(database_url: str) -> None:
    migration = CONCURRENT[0]
    name = "webhook_outbox_tenant_deliveries_idx"
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await _forget(conn, migration)
        for _ in range(2):
            await conn.execute(
                "INSERT INTO webhook_outbox (stream_id, event_type, payload, created_at)"
                " VALUES ('s', 't', '{}', '2030-01-01')"
            )
        # A build that failed half-way leaves its index INVALID (here: a unique one over
        # duplicates), as a cancelled or timed-out one does.
        with pytest.raises(psycopg.errors.UniqueViolation):
            await conn.execute(
                f"CREATE UNIQUE INDEX CONCURRENTLY {name} ON webhook_outbox (tenant, stream_id)"
                " WHERE NOT processed"
            )
        assert await _valid(conn, name) is False
        applied = await migrations.migrate(conn)
        assert [m.version for m in applied] == [migration.version]
        for index, _ in _indexes(migration):
            assert await _valid(conn, index), index
        cur = await conn.execute(
            "SELECT indisunique FROM pg_index WHERE indexrelid = to_regclass(%s)", (name,)
        )
        assert await cur.fetchone() == (False,)
        assert (await migrations.applied_versions(conn))[migration.version] == migration.checksum
        assert await migrations.migrate(conn) == []
        await migrations.check_schema(conn)


async def test_producers_insert_while_the_indexes_are_built(database_url: str) -> None:
    migration = CONCURRENT[0]
    async with (
        await psycopg.AsyncConnection.connect(database_url, autocommit=True) as admin,
        await psycopg.AsyncConnection.connect(database_url) as open_writer,
        await psycopg.AsyncConnection.connect(database_url, autocommit=True) as runner,
        await psycopg.AsyncConnection.connect(database_url, autocommit=True) as producer,
    ):
        await _forget(admin, migration)
        # A producer's transaction that stays open: the build waits for it to end ...
        await open_writer.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload) VALUES ('a', 't', '{}')"
        )
        running = asyncio.create_task(migrations.migrate(runner))
        cur = await admin.execute("SELECT pg_backend_pid()")
        for _ in range(200):
            cur = await admin.execute(
                "SELECT l.mode FROM pg_locks l JOIN pg_class c ON c.oid = l.relation"
                " WHERE l.pid = %s AND c.relname = 'webhook_outbox' AND l.granted",
                (runner.info.backend_pid,),
            )
            held = [r[0] for r in await cur.fetchall()]
            if held:
                break
            await asyncio.sleep(0.05)
        # ... holding only a lock that lets INSERTs through.
        assert held == ["ShareUpdateExclusiveLock"], held
        assert not running.done()
        await producer.execute("SET lock_timeout = '2s'")
        for _ in range(5):
            await producer.execute(
                "INSERT INTO webhook_outbox (stream_id, event_type, payload)"
                " VALUES ('b', 't', '{}')"
            )
        await open_writer.commit()
        applied = await asyncio.wait_for(running, 60)
        assert [m.version for m in applied] == [migration.version]
        for index, _ in _indexes(migration):
            assert await _valid(admin, index), index


async def test_two_migrates_at_once_apply_it_once(database_url: str) -> None:
    migration = CONCURRENT[0]
    async with (
        await psycopg.AsyncConnection.connect(database_url, autocommit=True) as admin,
        await psycopg.AsyncConnection.connect(database_url, autocommit=True) as one,
        await psycopg.AsyncConnection.connect(database_url, autocommit=True) as two,
        await psycopg.AsyncConnection.connect(database_url) as open_writer,
    ):
        await _forget(admin, migration)
        await open_writer.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload) VALUES ('a', 't', '{}')"
        )
        first = asyncio.create_task(migrations.migrate(one))
        await asyncio.sleep(0.3)
        second = asyncio.create_task(migrations.migrate(two))
        await asyncio.sleep(
            1.5
        )  # past deadlock_timeout: a waiting migrate must not hold a snapshot
        await open_writer.commit()
        results = await asyncio.wait_for(asyncio.gather(first, second), 60)
        assert sorted(len(r) for r in results) == [0, 1]
        for index, _ in _indexes(migration):
            assert await _valid(admin, index), index


async def test_a_partitioned_outbox_gets_the_indexes_on_every_partition(
    database_url: str,
) -> None:
    migration = CONCURRENT[0]
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload) VALUES ('a', 't', '{}')"
        )
        assert await partitions.convert(conn, interval_ms=86_400_000)
        await _forget(conn, migration)
        await conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload) VALUES ('b', 't', '{}')"
        )
        applied = await migrations.migrate(conn)
        assert [m.version for m in applied] == [migration.version]
        cur = await conn.execute(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
            " WHERE i.inhparent = 'webhook_outbox'::regclass"
        )
        parts = [r[0] for r in await cur.fetchall()]
        assert len(parts) >= 3
        for index, table in _indexes(migration):
            assert await _valid(conn, index), index
            if table != "webhook_outbox":
                continue
            cur = await conn.execute(
                "SELECT count(*) FROM pg_inherits WHERE inhparent = to_regclass(%s)", (index,)
            )
            assert await cur.fetchone() == (len(parts),), index
        # A partition made later has them too.
        made = await partitions.ensure_ahead(conn, ahead=6)
        assert made
        cur = await conn.execute(
            "SELECT count(*) FROM pg_indexes WHERE tablename = %s", (made[-1],)
        )
        row = await cur.fetchone()
        assert row is not None and row[0] >= len(partitions._INDEXES)


async def test_converting_to_partitions_keeps_the_read_indexes(database_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload) VALUES ('a', 't', '{}')"
        )
        assert await partitions.convert(conn, interval_ms=86_400_000)
        for index, table in _indexes(CONCURRENT[0]):
            assert await _valid(conn, index), index
            cur = await conn.execute(
                "SELECT indrelid::regclass::text FROM pg_index WHERE indexrelid = to_regclass(%s)",
                (index,),
            )
            assert await cur.fetchone() == (table,), index


async def test_a_stream_id_too_long_for_an_index_entry_does_not_fail_the_build(
    database_url: str,
) -> None:
    """Rows a plain SQL INSERT (or the first release) wrote with a stream id of kilobytes,
    processed long ago: the stream indexes leave them out, so the build succeeds, and a
    search by such a stream finds nothing rather than failing."""
    migration = CONCURRENT[0]
    stream_id = secrets.token_hex(1700)  # 3,400 characters that do not compress
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await _forget(conn, migration)
        await conn.execute(
            "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload, processed,"
            " outcome, endpoint_id, processed_at) VALUES ('t', %s, 'e', '{}', true,"
            " 'delivered', NULL, now()), ('t', %s, 'e', '{}', true, 'delivered', 'ep_x', now())",
            (stream_id, stream_id),
        )
        applied = await migrations.migrate(conn)
        assert [m.version for m in applied] == [migration.version]
        for index, _ in _indexes(migration):
            assert await _valid(conn, index), index
        await migrations.check_schema(conn)


async def test_a_migrate_waiting_for_another_says_so(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A migrate behind another one (a concurrent build on a big outbox takes minutes)
    says at once that it waits for the migration lock, and when it took it: it looked
    hung, with nothing printed."""
    caplog.set_level("INFO", logger="fluxora_webhooks.migrations")
    async with (
        await psycopg.AsyncConnection.connect(database_url, autocommit=True) as holder,
        await psycopg.AsyncConnection.connect(database_url, autocommit=True) as waiter,
    ):
        await holder.execute("SELECT pg_advisory_lock(%s)", (migrations.MIGRATION_LOCK_KEY,))
        waiting = asyncio.create_task(migrations.migrate(waiter))
        for _ in range(100):
            if "waiting for the migration lock" in caplog.text:
                break
            await asyncio.sleep(0.05)
        assert "waiting for the migration lock: another migrate" in caplog.text
        assert not waiting.done()
        await holder.execute("SELECT pg_advisory_unlock(%s)", (migrations.MIGRATION_LOCK_KEY,))
        assert await asyncio.wait_for(waiting, 30) == []  # nothing left to apply
    assert "took the migration lock after" in caplog.text
