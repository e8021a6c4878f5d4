"""Migrations (recorded, locked, idempotent), the schema check, and the claim's query plan."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

from fluxora_webhooks.errors import SchemaError
from fluxora_webhooks.migrations import (
    available,
    check_schema,
    discard,
    latest_version,
    migrate,
)
from fluxora_webhooks.queries import query
from tests.support import engines

pytestmark = pytest.mark.integration


async def _connect(url: str) -> psycopg.AsyncConnection[Any]:
    return await psycopg.AsyncConnection.connect(url, autocommit=True)


async def test_migrate_is_recorded_and_idempotent(empty_database_url: str) -> None:
    async with await _connect(empty_database_url) as conn:
        with pytest.raises(SchemaError, match="run `fluxora-webhooks migrate`"):
            await check_schema(conn)
        first = await migrate(conn)
        assert [m.version for m in first] == [m.version for m in available()]
        assert await migrate(conn) == []
        await check_schema(conn)
        cur = await conn.execute("SELECT version, name FROM fluxora_schema_migrations")
        assert [r[0] for r in await cur.fetchall()] == list(range(1, latest_version() + 1))


async def test_concurrent_migrate_applies_each_migration_once(empty_database_url: str) -> None:
    async def one() -> int:
        async with await _connect(empty_database_url) as conn:
            return len(await migrate(conn))

    applied = await asyncio.gather(*(one() for _ in range(4)))
    assert sorted(applied) == [0, 0, 0, latest_version()]


async def test_schema_newer_than_the_code_is_refused(database_url: str) -> None:
    async with await _connect(database_url) as conn:
        await conn.execute(
            "INSERT INTO fluxora_schema_migrations (version, name, checksum)"
            " VALUES (%s, 'from_the_future', 'x')",
            (latest_version() + 1,),
        )
        with pytest.raises(SchemaError, match="newer than this fluxora-webhooks supports"):
            await check_schema(conn)
        with pytest.raises(SchemaError, match="upgrade fluxora-webhooks"):
            await migrate(conn)


async def test_schema_older_than_the_code_is_refused(database_url: str) -> None:
    async with await _connect(database_url) as conn:
        await conn.execute(
            "DELETE FROM fluxora_schema_migrations WHERE version = %s", (latest_version(),)
        )
        with pytest.raises(SchemaError, match="run `fluxora-webhooks migrate`"):
            await check_schema(conn)


@pytest.mark.slow
async def test_claim_uses_the_partial_index_with_a_million_processed_rows(
    database_url: str,
) -> None:
    async with await _connect(database_url) as conn:
        await conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload, processed, created_at)"
            " SELECT 's' || g, 'e', '{}'::jsonb, true, now() - interval '1 day'"
            " FROM generate_series(1, 1000000) g"
        )
        await conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload)"
            " SELECT 'p' || g, 'e', '{}'::jsonb FROM generate_series(1, 100) g"
        )
        await conn.execute("ANALYZE webhook_outbox")
        async with conn.transaction():
            cur = await conn.execute("EXPLAIN (FORMAT JSON) " + query("claim_due"), {"batch": 10})
            row = await cur.fetchone()
        assert row is not None
        plan = row[0] if isinstance(row[0], list) else json.loads(row[0])
        scans = list(_nodes(plan[0]["Plan"]))
        index_scans = [n for n in scans if n.get("Index Name") == "webhook_outbox_due_idx"]
        assert index_scans, f"claim does not use the partial index: {scans}"
        # No scan of the outbox itself (the routable look may scan the endpoints table,
        # a page here, once per claimed event row).
        outbox_scans = [
            n
            for n in scans
            if n["Node Type"] == "Seq Scan" and n.get("Relation Name") == "webhook_outbox"
        ]
        assert not outbox_scans, outbox_scans
        async with conn.transaction():
            cur = await conn.execute(
                "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + query("claim_due"), {"batch": 10}
            )
            row = await cur.fetchone()
        assert row is not None
        analyzed = row[0] if isinstance(row[0], list) else json.loads(row[0])
        # The claim reads a handful of pages, not the million processed rows.
        buffers = analyzed[0]["Plan"].get("Shared Hit Blocks", 0) + analyzed[0]["Plan"].get(
            "Shared Read Blocks", 0
        )
        assert buffers < 200, f"claim touched {buffers} pages"


def _nodes(plan: dict[str, Any]) -> Any:
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


async def test_a_sql_ascii_database_is_refused_with_a_clear_message(
    pg_admin_url: str,
) -> None:
    """Under SQL_ASCII PostgreSQL returns text as bytes; migrate and the schema check say
    what is wrong instead of failing later with a misleading checksum error."""
    name = f"fluxora_ascii_{uuid.uuid4().hex[:10]}"
    async with await psycopg.AsyncConnection.connect(pg_admin_url, autocommit=True) as admin:
        await admin.execute(
            sql.SQL(
                "CREATE DATABASE {} ENCODING 'SQL_ASCII' TEMPLATE template0"
                " LC_COLLATE 'C' LC_CTYPE 'C'"
            ).format(sql.Identifier(name))
        )
    try:
        url = engines.with_dbname(pg_admin_url, name)
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            with pytest.raises(SchemaError, match=r"encoding is SQL_ASCII.*needs a UTF8"):
                await migrate(conn)
            with pytest.raises(SchemaError, match="encoding is SQL_ASCII"):
                await check_schema(conn)
    finally:
        async with await psycopg.AsyncConnection.connect(pg_admin_url, autocommit=True) as admin:
            await admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


async def test_a_connection_discarded_on_purpose_goes_back_to_its_pool_unwarned(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """On a standby every claim loop's retry discards the connection that found it
    read-only: psycopg_pool's "discarding closed connection" warning is not written for
    those (it still is for a connection the server closed), and the pool opens another."""
    async with AsyncConnectionPool(database_url, min_size=1, max_size=1, open=False) as pool:
        await pool.open(wait=True)
        with caplog.at_level(logging.WARNING, logger="psycopg.pool"):
            conn = await pool.getconn()
            await discard(conn)
            await pool.putconn(conn)
            assert "discarding closed connection" not in caplog.text
            conn = await pool.getconn(timeout=10)  # another one
            assert not conn.closed
            await conn.close()  # not on purpose: still said
            await pool.putconn(conn)
        assert "discarding closed connection" in caplog.text
