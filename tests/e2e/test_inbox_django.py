"""The Django example (examples/consumer_django.py) as its reader runs it: ``setup``, then
``runserver``, on the test's own database, driven over real HTTP with signed requests."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import psycopg
import pytest

from tests.support.dispatch import SECRET
from tests.support.inbox import Delivery, delivery
from tests.support.procs import command_env, free_port

pytestmark = pytest.mark.e2e

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "consumer_django.py"


@pytest.fixture
async def django_url(empty_database_url: str, tmp_path: Path) -> AsyncIterator[str]:
    env = command_env(DATABASE_URL=empty_database_url, WEBHOOK_SECRET=SECRET.decode())
    setup = await asyncio.create_subprocess_exec(
        sys.executable, str(EXAMPLE), "setup", env=env, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await asyncio.wait_for(setup.communicate(), 60)
    assert setup.returncode == 0 and out.decode().strip() == "created webhook_inbox"
    port = free_port()
    log = tmp_path / "django.log"
    with log.open("wb") as sink:
        server = await asyncio.create_subprocess_exec(
            sys.executable, str(EXAMPLE), "runserver", f"127.0.0.1:{port}", "--noreload",
            env=env, stdout=sink, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.returncode is None, log.read_text()
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                assert time.monotonic() < deadline, log.read_text()
                await asyncio.sleep(0.05)
                continue
            writer.close()
            await writer.wait_closed()
            break
        yield f"http://127.0.0.1:{port}/webhooks"
    finally:
        if server.returncode is None:
            server.send_signal(signal.SIGTERM)
        await asyncio.wait_for(server.wait(), 20)


async def post(http: aiohttp.ClientSession, url: str, d: Delivery) -> tuple[int, Any]:
    async with http.post(url, data=d.body, headers=d.headers) as resp:
        body = await resp.read()
        is_json = resp.content_type == "application/json"
        return resp.status, await resp.json() if is_json else body


async def test_the_django_example_applies_each_event_once(
    django_url: str, empty_database_url: str
) -> None:
    credit = delivery({"account": "alice", "amount": 50})
    overdraw = delivery({"account": "alice", "amount": -80})
    async with aiohttp.ClientSession() as http:
        assert await post(http, django_url, credit) == (
            200,
            {"status": "processed", "delivery_id": credit.delivery_id},
        )
        assert await post(http, django_url, credit) == (200, {"status": "duplicate"})
        forged = delivery({"account": "alice", "amount": 10**9}, secret=b"x" * 32)
        assert await post(http, django_url, forged) == (
            401,
            {"error": "verification_failed", "reason": "no_matching_signature"},
        )
        status, _ = await post(http, django_url, overdraw)
        assert status == 500  # the CHECK failed: rolled back, id and all
        more = delivery({"account": "alice", "amount": 40})
        assert (await post(http, django_url, more))[0] == 200
        retry = delivery(overdraw.payload(), delivery_id=overdraw.delivery_id, attempt=2)
        got = await post(http, django_url, retry)
        assert got[0] == 200 and got[1]["status"] == "processed", got
        async with http.get(django_url) as resp:
            assert resp.status == 405
    async with await psycopg.AsyncConnection.connect(empty_database_url) as conn:
        balance = await (await conn.execute("SELECT amount FROM example_balances")).fetchall()
        ids = await (await conn.execute("SELECT delivery_id FROM webhook_inbox")).fetchall()
    assert balance == [(10,)]
    assert sorted(r[0] for r in ids) == sorted(
        [credit.delivery_id, more.delivery_id, overdraw.delivery_id]
    )
