"""Rows past a fast endpoint's WEBHOOK_ENDPOINT_CONCURRENCY wait in the process for a slot
(first come, first served) instead of going back to the outbox: never more requests at
once than the limit, and no deferral written for them (SPEC 11)."""

from __future__ import annotations

import asyncio

import psycopg
from aiohttp import web

from fluxora_webhooks.outbox import enqueue
from fluxora_webhooks.targets import Load
from tests.support.dispatch import make_settings, pending, rows, running_dispatcher, wait_until
from tests.support.receiver import Received, Receiver


async def test_rows_past_the_limit_wait_for_a_slot_and_are_not_deferred(
    database_url: str, receiver: Receiver
) -> None:
    now = peak = 0

    async def respond(r: Received) -> web.Response:
        nonlocal now, peak
        now += 1
        peak = max(peak, now)
        await asyncio.sleep(0.02)
        now -= 1
        return web.Response()

    receiver.respond = respond
    async with await psycopg.AsyncConnection.connect(database_url) as conn, conn.transaction():
        for i in range(40):
            await enqueue(conn, stream_id=f"s-{i}", event_type="e", payload={"i": i})
    settings = make_settings(receiver.url, batch_size=20, claim_loops=2, endpoint_concurrency=3)
    async with running_dispatcher(settings, database_url):
        await wait_until(lambda: _drained(database_url), timeout=30, what="all delivered")
    assert len(receiver.received) == 40
    assert peak == 3  # the limit held, and was used
    got = await rows(
        database_url, "SELECT outcome, sum(deferrals) FROM webhook_outbox GROUP BY outcome"
    )
    assert got == [("delivered", 0)]


async def _drained(database_url: str) -> bool:
    return await pending(database_url) == 0


async def test_a_slot_goes_to_the_longest_waiting_row_and_a_cancelled_wait_passes_it_on() -> None:
    load = Load(in_flight=1)
    order: list[str] = []

    async def take(name: str) -> None:
        await load.acquire(1)
        order.append(name)

    first = asyncio.create_task(take("first"))
    gone = asyncio.create_task(take("gone"))
    last = asyncio.create_task(take("last"))
    await asyncio.sleep(0)
    assert load.queued == 3 and order == []
    gone.cancel()
    load.release()  # to "first"
    await asyncio.sleep(0)
    assert order == ["first"] and load.in_flight == 1
    load.release()  # "gone" was cancelled: to "last"
    await asyncio.gather(first, last, return_exceptions=True)
    assert order == ["first", "last"] and load.in_flight == 1
    load.release()
    assert load.in_flight == 0 and load.queued == 0
    await load.acquire(1)  # a free slot with nobody waiting is taken at once
    assert load.in_flight == 1
