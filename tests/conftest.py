"""Shared fixtures: a fresh database per test (cloned from a migrated template), a Redis key
prefix per test, and a real HTTP receiver on loopback.

Engines: ``FLUXORA_TEST_DATABASE_URL`` / ``FLUXORA_TEST_REDIS_URL`` when set, else the local
PostgreSQL and Redis on 127.0.0.1, else the embedded engines (so the suite runs on a machine
with neither installed).
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import psycopg
import pytest
import pytest_asyncio
from psycopg import sql
from redis.asyncio import Redis

from fluxora_webhooks.inbox import install as install_inbox
from fluxora_webhooks.migrations import migrate
from tests.support import engines
from tests.support.receiver import Receiver


@pytest.fixture(scope="session")
def pg_admin_url() -> str:
    return engines.admin_database_url()


@pytest.fixture(scope="session")
def template_db(pg_admin_url: str, worker_id: str) -> Iterator[str]:
    name = f"fluxora_tmpl_{worker_id}_{os.getpid()}"
    with psycopg.connect(pg_admin_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))

    async def _migrate() -> None:
        async with await psycopg.AsyncConnection.connect(
            engines.with_dbname(pg_admin_url, name), autocommit=True
        ) as aconn:
            await migrate(aconn)

    asyncio.run(_migrate())
    yield name
    with psycopg.connect(pg_admin_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


@pytest.fixture
def database_url(pg_admin_url: str, template_db: str) -> Iterator[str]:
    """A migrated database of this test's own."""
    with engines.copied_database(pg_admin_url, template_db, "fluxora_t_") as url:
        yield url


@pytest.fixture
def empty_database_url(pg_admin_url: str) -> Iterator[str]:
    """A database with no schema at all."""
    name = f"fluxora_e_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_admin_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    yield engines.with_dbname(pg_admin_url, name)
    with psycopg.connect(pg_admin_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


@pytest.fixture
def inbox_database_url(empty_database_url: str) -> str:
    """A consumer's own database (no outbox) with the inbox installed."""
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        install_inbox(conn)
    return empty_database_url


@pytest.fixture(scope="session")
def redis_url() -> str:
    return engines.redis_url()


@pytest.fixture
def redis_prefix() -> str:
    """A key prefix of this test's own, for processes (never a flush: tests run in parallel)."""
    return f"test:{uuid.uuid4().hex[:12]}:"


@pytest_asyncio.fixture
async def redis_client(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    try:
        yield client
    finally:
        await client.aclose()


@pytest_asyncio.fixture
async def prefix(redis_client: Redis) -> AsyncIterator[str]:
    """A key prefix of this test's own; its keys are deleted afterwards."""
    value = f"test:{uuid.uuid4().hex[:12]}:"
    yield value
    keys = [key async for key in redis_client.scan_iter(match=f"{value}*")]
    if keys:
        await redis_client.delete(*keys)


@pytest_asyncio.fixture
async def receiver() -> AsyncIterator[Receiver]:
    recv = Receiver()
    await recv.start()
    try:
        yield recv
    finally:
        await recv.stop()


@pytest.fixture(scope="session")
def worker_id(request: pytest.FixtureRequest) -> str:
    return str(getattr(request.config, "workerinput", {}).get("workerid", "main"))


def pytest_configure(config: Any) -> None:
    os.environ.setdefault("FLUXORA_TESTING", "1")
