"""The same delivery posted to two consumer processes at the same moment (two dispatchers
racing after a crash do exactly that) is applied once.

Each consumer holds its transaction open after its writes until the test lets it go (an
advisory lock), so the race is certain, not a matter of timing: the second process is seen
waiting on the first one's uncommitted inbox row before the first is allowed to finish."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import psycopg
import pytest

from tests.support.dispatch import SECRET
from tests.support.inbox import ConsumerProcess, Delivery, delivery
from tests.support.inbox_consumer import prepare
from tests.support.procs import command_env, free_port

pytestmark = pytest.mark.e2e

HOLD = 0x1A2B3C


async def _waiting(conn: psycopg.AsyncConnection[Any], locktype: str) -> int:
    cur = await conn.execute(
        "SELECT count(*) FROM pg_locks WHERE NOT granted AND locktype = %s"
        " AND pid <> pg_backend_pid()",
        (locktype,),
    )
    row = await cur.fetchone()
    return int(row[0]) if row else 0


async def _until_waiting(conn: psycopg.AsyncConnection[Any], locktype: str) -> None:
    deadline = time.monotonic() + 20
    while not await _waiting(conn, locktype):
        assert time.monotonic() < deadline, f"no backend waiting on a {locktype} lock"
        await asyncio.sleep(0.02)


async def _post(http: aiohttp.ClientSession, url: str, d: Delivery) -> tuple[int, Any]:
    async with http.post(url, data=d.body, headers=d.headers) as resp:
        return resp.status, await resp.json()


async def _consumer_state(url: str) -> tuple[int, list[tuple[str, int]], int]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        balance = await (await conn.execute("SELECT amount FROM balance")).fetchone()
        applied = await (await conn.execute("SELECT delivery_id, count FROM applied")).fetchall()
        inbox = await (await conn.execute("SELECT count(*) FROM webhook_inbox")).fetchone()
    assert balance is not None and inbox is not None
    return int(balance[0]), [(r[0], int(r[1])) for r in applied], int(inbox[0])


def _consumer(url: str, tmp_path: Path, name: str, **extra: str) -> ConsumerProcess:
    env = command_env(
        CONSUMER_DATABASE_URL=url,
        WEBHOOK_SECRET=SECRET.decode(),
        CONSUMER_HOLD_LOCK=str(HOLD),
        **extra,
    )
    return ConsumerProcess(free_port(), env, tmp_path / f"{name}.log", keep_spare=False)


@pytest.fixture
async def gate(inbox_database_url: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """The consumers' database, prepared, and a session holding the lock they wait for."""
    await prepare(inbox_database_url)
    async with await psycopg.AsyncConnection.connect(inbox_database_url, autocommit=True) as c:
        await c.execute("SELECT pg_advisory_lock(%s)", (HOLD,))
        yield c


@pytest.mark.parametrize("first_outcome", ["commits", "dies before its commit"])
async def test_the_same_delivery_at_two_consumers_at_once_applies_once(
    inbox_database_url: str,
    gate: psycopg.AsyncConnection[Any],
    tmp_path: Path,
    first_outcome: str,
) -> None:
    dies = {"CONSUMER_KILL_BEFORE_COMMIT_RATE": "1"} if first_outcome != "commits" else {}
    first = _consumer(inbox_database_url, tmp_path, "first", **dies)
    second = _consumer(inbox_database_url, tmp_path, "second")
    await asyncio.gather(first.start(), second.start())
    d = delivery({"amount": 25})
    try:
        async with aiohttp.ClientSession() as http:
            to_first = asyncio.create_task(_post(http, first.url, d))
            await _until_waiting(gate, "advisory")  # first: written, holding, uncommitted
            to_second = asyncio.create_task(_post(http, second.url, d))
            await _until_waiting(gate, "transactionid")  # second: waits on first's row
            assert not to_first.done() and not to_second.done()

            await gate.execute("SELECT pg_advisory_unlock(%s)", (HOLD,))
            second_answer = await asyncio.wait_for(to_second, 20)
            if first_outcome == "commits":
                assert await asyncio.wait_for(to_first, 20) == (
                    200,
                    {"status": "processed", "delivery_id": d.delivery_id},
                )
                assert second_answer[1]["status"] == "duplicate"
            else:
                with pytest.raises(aiohttp.ClientError):
                    await asyncio.wait_for(to_first, 20)  # killed: no answer at all
                assert first.self_kills("before-commit") == [d.delivery_id]
                assert second_answer[1]["status"] == "processed"  # the rollback freed it
            assert second_answer[0] == 200
    finally:
        await first.stop()
        await second.stop()
    assert await _consumer_state(inbox_database_url) == (25, [(d.delivery_id, 1)], 1)
