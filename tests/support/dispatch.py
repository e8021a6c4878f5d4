"""Run a dispatcher inside a test, and wait for conditions on the database."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import psycopg

from fluxora_webhooks.dispatcher import Dispatcher
from fluxora_webhooks.gate import DeliveryGate
from fluxora_webhooks.retry import RetryPolicy
from fluxora_webhooks.secretbox import Keyring, keyring_from_env
from fluxora_webhooks.settings import Settings

SECRET = b"test-secret-that-is-long-enough-0123456789"


def make_settings(url: str, **overrides: Any) -> Settings:
    base = Settings(
        webhook_url=url,
        secret=SECRET,
        poll_interval_ms=200,
        batch_size=10,
        claim_loops=2,
        timeout_ms=2000,
        retry_schedule_ms=(50,),
        metrics_port=0,
    )
    return dataclasses.replace(base, **overrides)


@contextlib.asynccontextmanager
async def running_dispatcher(
    settings: Settings,
    database_url: str,
    *,
    gate: DeliveryGate | None = None,
    policy: RetryPolicy | None = None,
) -> AsyncIterator[Dispatcher]:
    dispatcher = Dispatcher(settings, conninfo=database_url, gate=gate, policy=policy)
    task = asyncio.create_task(dispatcher.run())
    await dispatcher.ready.wait()
    try:
        yield dispatcher
    finally:
        dispatcher.stop()
        await asyncio.wait_for(task, 30)


async def wait_until(
    check: Callable[[], Awaitable[bool]], timeout: float = 15.0, what: str = "condition"
) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def scalar(database_url: str, sql: str, params: Any = None) -> Any:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        cur = await conn.execute(sql, params)
        row = await cur.fetchone()
        return None if row is None else row[0]


async def rows(database_url: str, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        cur = await conn.execute(sql, params)
        return list(await cur.fetchall())


async def enqueue_many(
    database_url: str, n: int, event_type: str = "stream.updated", *, tenant: str = ""
) -> None:
    """``n`` events (of ``tenant``) by plain SQL, as a producer in any language would write
    them."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload)"
            " SELECT %s, 's-' || g, %s, jsonb_build_object('n', g)"
            " FROM generate_series(1, %s) g",
            (tenant, event_type, n),
        )


async def delivered(database_url: str) -> int:
    """Outbox rows recorded as delivered."""
    return int(
        await scalar(
            database_url, "SELECT count(*) FROM webhook_outbox WHERE outcome = 'delivered'"
        )
    )


async def pending(database_url: str) -> int:
    return int(
        await scalar(database_url, "SELECT count(*) FROM webhook_outbox WHERE NOT processed")
    )


def keyring(current: str | None, previous: str | None = None) -> Keyring:
    """The keys a process with WEBHOOK_ENCRYPTION_KEY (and _PREVIOUS) set holds."""
    env = {}
    if current is not None:
        env["WEBHOOK_ENCRYPTION_KEY"] = current
    if previous is not None:
        env["WEBHOOK_ENCRYPTION_KEY_PREVIOUS"] = previous
    return keyring_from_env(env)


async def due_now(database_url: str, endpoint_id: str) -> None:
    """The endpoint's waiting deliveries made due now (they wait out a deferral otherwise)."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "UPDATE webhook_outbox SET created_at = now() WHERE endpoint_id = %s AND NOT processed",
            (endpoint_id,),
        )


async def deferred(database_url: str, endpoint_id: str) -> int:
    """The endpoint's deliveries waiting for a later time (deferred or held), unprocessed."""
    return int(
        await scalar(
            database_url,
            "SELECT count(*) FROM webhook_outbox WHERE endpoint_id = %s AND NOT processed"
            " AND created_at > now()",
            (endpoint_id,),
        )
    )
