"""Wake-ups: NOTIFY within milliseconds, the next due time, and no spinning when idle."""

from __future__ import annotations

import asyncio
import time

import psycopg
import pytest

from fluxora_webhooks.outbox import enqueue
from tests.support.dispatch import make_settings, pending, running_dispatcher, wait_until
from tests.support.receiver import Receiver

pytestmark = pytest.mark.integration


async def test_an_idle_dispatcher_does_not_spin(database_url: str, receiver: Receiver) -> None:
    settings = make_settings(receiver.url, poll_interval_ms=200, claim_loops=2)
    async with running_dispatcher(settings, database_url) as dispatcher:
        await asyncio.sleep(0.3)
        before = dispatcher.batches
        await asyncio.sleep(1.0)
        claims = dispatcher.batches - before
    # Two loops polling every 200 ms claim about ten times a second, not thousands.
    assert claims <= 20, claims


async def test_rows_locked_by_another_worker_do_not_make_idle_loops_spin(
    database_url: str, receiver: Receiver
) -> None:
    async with await psycopg.AsyncConnection.connect(database_url) as other:
        await enqueue(other, stream_id="s", event_type="e", payload={})
        await other.commit()
        # Another worker holds the due row for a while (as during a slow HTTP attempt).
        await other.execute("SELECT id FROM webhook_outbox FOR UPDATE")
        settings = make_settings(receiver.url, poll_interval_ms=200, claim_loops=2)
        async with running_dispatcher(settings, database_url) as dispatcher:
            await asyncio.sleep(0.3)
            before = dispatcher.batches
            await asyncio.sleep(1.0)
            claims = dispatcher.batches - before
            await other.rollback()  # the worker "crashed": the row is free again
            await receiver.wait_for(1, timeout=5)  # picked up by the poll fallback
    assert claims <= 20, claims


async def test_notify_wakes_the_dispatcher_long_before_the_poll_interval(
    database_url: str, receiver: Receiver
) -> None:
    settings = make_settings(receiver.url, poll_interval_ms=60_000, claim_loops=2)
    async with running_dispatcher(settings, database_url):
        await asyncio.sleep(0.3)  # everyone is asleep on a one-minute poll
        async with await psycopg.AsyncConnection.connect(database_url) as conn:
            await enqueue(conn, stream_id="s", event_type="e", payload={"n": 1})
            await conn.commit()
            committed = time.time()
        await receiver.wait_for(1, timeout=10)
    assert receiver.received[0].at - committed < 1  # NOTIFY, not the 60 s poll


async def test_a_retry_due_later_is_picked_up_at_its_due_time_without_notify(
    database_url: str, receiver: Receiver
) -> None:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload, created_at)"
            " VALUES ('s', 'e', '{}', now() + interval '700 milliseconds')"
        )
    settings = make_settings(receiver.url, poll_interval_ms=60_000, claim_loops=1)
    async with running_dispatcher(settings, database_url):
        await receiver.wait_for(1, timeout=10)
        await wait_until(lambda: _idle(database_url), what="idle")


async def _idle(database_url: str) -> bool:
    return await pending(database_url) == 0
