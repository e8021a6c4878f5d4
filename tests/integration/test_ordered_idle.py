"""An ordered endpoint's delivery is due at once when its stream is idle (SPEC 14): the batch
that routes the event holds the stream's lock, sees none of its deliveries pending and no
earlier event of it still to be routed, and sends the delivery itself. Otherwise the
delivery waits for its turn as before. No transaction of a dispatcher waits for a stream's
lock: a stream another transaction holds is chosen after the commit."""

from __future__ import annotations

import asyncio
import ipaddress
import json
from typing import Any

import psycopg
import pytest

from fluxora_webhooks import endpoints, enqueue
from fluxora_webhooks.outbox import claim_due, route_events, try_promote_heads
from tests.integration.test_fanout import _settled
from tests.support.dispatch import make_settings, rows, running_dispatcher, wait_until
from tests.support.receiver import Receiver

pytestmark = pytest.mark.integration

LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"),)
LOCK = "SELECT pg_advisory_xact_lock(hashtextextended(%s || chr(31) || %s, 1718973816))"


async def _connect(url: str) -> psycopg.AsyncConnection[Any]:
    return await psycopg.AsyncConnection.connect(url, autocommit=True)


async def _ordered(conn: psycopg.AsyncConnection[Any], url: str) -> str:
    endpoint, _ = await endpoints.create(
        conn, url=url, tenant="acme", ordered=True, allowed_networks=LOOPBACK
    )
    return endpoint.id


async def _numbers(receiver: Receiver) -> list[int]:
    return [json.loads(hit.body)["n"] for hit in receiver.received]


async def test_several_events_of_a_stream_in_one_batch_arrive_in_order(
    database_url: str,
) -> None:
    """One batch claims five events of stream "s" and one of stream "t". The burst of "s"
    takes no lock (its events would wait for the first anyway, and a lock held through
    the batch would only hold up the other batches of the burst): they wait, and arrive in
    order. "t"'s delivery is due at once and sent by the batch that routes it."""
    receiver = Receiver()
    await receiver.start()
    try:
        async with await _connect(database_url) as conn:
            endpoint_id = await _ordered(conn, receiver.url)
            async with conn.transaction():
                for n in range(1, 6):
                    await enqueue(
                        conn, tenant="acme", stream_id="s", event_type="e", payload={"n": n}
                    )
                await enqueue(conn, tenant="acme", stream_id="t", event_type="e", payload={"n": 0})
        settings = make_settings("", allowed_networks=LOOPBACK, claim_loops=1, batch_size=10)
        async with running_dispatcher(settings, database_url):
            await wait_until(lambda: _settled(database_url), what="all delivered")
        numbers = await _numbers(receiver)
        assert [n for n in numbers if n] == [1, 2, 3, 4, 5]
        assert numbers[0] == 0, "the idle stream's delivery went with the routing batch"
    finally:
        await receiver.stop()
    # Written (and recorded) by the transaction that routed the event: "t"'s delivery only.
    found = await rows(
        database_url,
        "SELECT d.stream_id, (d.payload->>'n')::int, d.xmin = ev.xmin FROM webhook_outbox d"
        " JOIN webhook_outbox ev ON ev.id = d.event_id WHERE d.endpoint_id = %s"
        " ORDER BY 1, 2",
        (endpoint_id,),
    )
    assert found == [("s", n, False) for n in range(1, 6)] + [("t", 0, True)]


async def test_a_stream_locked_elsewhere_waits_and_is_chosen_after_the_commit(
    database_url: str,
) -> None:
    """While another transaction holds the stream's lock, the routing batch neither waits
    for it nor makes the delivery due: the delivery waits, and the dispatcher chooses it
    once that transaction is over (after its own commit, in a transaction of its own)."""
    receiver = Receiver()
    await receiver.start()
    try:
        async with await _connect(database_url) as conn:
            endpoint_id = await _ordered(conn, receiver.url)
        settings = make_settings("", allowed_networks=LOOPBACK, claim_loops=1)
        async with (
            await _connect(database_url) as holder,
            running_dispatcher(settings, database_url),
        ):
            async with holder.transaction():
                await holder.execute(LOCK, (endpoint_id, "s"))
                async with await _connect(database_url) as conn:
                    await enqueue(
                        conn, tenant="acme", stream_id="s", event_type="e", payload={"n": 1}
                    )

                async def waiting() -> bool:
                    found = await rows(
                        database_url,
                        "SELECT hold FROM webhook_outbox WHERE endpoint_id = %s",
                        (endpoint_id,),
                    )
                    return found == [("waiting",)]

                # Routed and committed while the lock is held here: it waits.
                await wait_until(waiting, what="the delivery routed, waiting")
                await asyncio.sleep(0.3)
                assert receiver.received == []
                assert await waiting()
            # The lock is free: the dispatcher's choice after its commit goes on.
            await wait_until(lambda: _settled(database_url), what="delivered")
        assert await _numbers(receiver) == [1]
    finally:
        await receiver.stop()


async def test_an_earlier_event_still_to_be_routed_keeps_the_next_one_waiting(
    database_url: str,
) -> None:
    """The first event of a stream is claimed by another batch (not yet routed): the
    second, routed with the stream's lock and no delivery pending, still waits."""
    async with await _connect(database_url) as conn:
        endpoint_id = await _ordered(conn, "http://127.0.0.1:9/")
        async with conn.transaction():
            for n in (1, 2):
                await enqueue(conn, tenant="acme", stream_id="s", event_type="e", payload={"n": n})
    async with (
        await psycopg.AsyncConnection.connect(database_url) as first,
        await psycopg.AsyncConnection.connect(database_url) as second,
    ):
        claimed = await claim_due(first, 1)  # the first event, locked by this transaction
        assert [json.loads(r.body)["n"] for r in claimed] == [1]
        async with second.transaction():
            events = {r.id: r.partition_at for r in await claim_due(second, 10)}
            assert len(events) == 1  # the second event: the first is locked
            await second.execute(LOCK, (endpoint_id, "s"))
            routing = await route_events(second, events, cap=10, locked={(endpoint_id, "s")})
            assert routing.due == []
            cur = await second.execute(
                "SELECT hold FROM webhook_outbox WHERE endpoint_id = %s", (endpoint_id,)
            )
            assert await cur.fetchall() == [("waiting",)]
        await first.rollback()


async def test_an_idle_stream_without_its_lock_waits(database_url: str) -> None:
    """The same routing without the stream's lock (another transaction has it): the
    delivery waits, though nothing of the stream is pending."""
    async with await _connect(database_url) as conn:
        endpoint_id = await _ordered(conn, "http://127.0.0.1:9/")
        await enqueue(conn, tenant="acme", stream_id="s", event_type="e", payload={"n": 1})
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        async with conn.transaction():
            events = {r.id: r.partition_at for r in await claim_due(conn, 10)}
            routing = await route_events(conn, events, cap=10, locked=set())
            assert routing.due == []
            raise psycopg.Rollback()
        async with conn.transaction():
            # Rolled back above: routed again, now with the lock.
            events = {r.id: r.partition_at for r in await claim_due(conn, 10)}
            await conn.execute(LOCK, (endpoint_id, "s"))
            routing = await route_events(conn, events, cap=10, locked={(endpoint_id, "s")})
            assert [r.endpoint_id for r in routing.due] == [endpoint_id]
            assert [r.stream_seq for r in routing.due] == list(events)


async def test_promoting_in_a_transaction_never_waits_for_a_stream(database_url: str) -> None:
    """A stream whose lock another transaction holds is returned as busy at once; one whose
    lock is free has its waiting head made due."""
    async with await _connect(database_url) as conn:
        endpoint_id = await _ordered(conn, "http://127.0.0.1:9/")
        for stream in ("a", "b"):
            await conn.execute(
                "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload,"
                " endpoint_id, event_id, stream_seq, hold, created_at)"
                " VALUES ('acme', %s, 'e', '{}', %s, 1, 1, 'waiting', 'infinity')",
                (stream, endpoint_id),
            )
    async with (
        await psycopg.AsyncConnection.connect(database_url) as holder,
        await psycopg.AsyncConnection.connect(database_url) as conn,
    ):
        await holder.execute(LOCK, (endpoint_id, "a"))
        async with asyncio.timeout(5):
            promoted, busy = await try_promote_heads(conn, [(endpoint_id, "a"), (endpoint_id, "b")])
        assert promoted == 1
        assert busy == [(endpoint_id, "a")]
        await conn.commit()
        await holder.rollback()
    found = await rows(
        database_url,
        "SELECT stream_id, hold FROM webhook_outbox WHERE endpoint_id = %s ORDER BY 1",
        (endpoint_id,),
    )
    assert found == [("a", "waiting"), ("b", None)]
