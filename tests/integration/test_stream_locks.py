"""Ordered streams' locks stay few per transaction (SPEC 14). Each is an entry of the
server's one lock table, shared by every session of every database on it: an enable that
locked thousands of parked streams in one transaction failed with "out of shared memory"
after its commit (the heads then came one sweep page every 30 s), and batches that routed
events to many ordered endpoints made a producer's own transaction fail the same way.

A server of the test's own with a small lock table (about 500 to 1,000 locks in all)."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from fluxora_webhooks import dispatcher as dispatcher_module
from fluxora_webhooks import endpoints
from fluxora_webhooks.migrations import migrate
from fluxora_webhooks.outbox import (
    MAX_STREAM_LOCKS,
    PROMOTE_CHUNK,
    Completion,
    Outcome,
    claim_due,
    complete,
    promote_heads,
    try_lock_streams,
    try_promote_heads,
)
from tests.support.chaos import OwnPostgres, own_postgres_running

pytestmark = pytest.mark.integration

LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"),)
STREAMS = 1500  # past the small server's lock table


@pytest.fixture(scope="module")
def small_locks() -> Iterator[OwnPostgres]:
    with own_postgres_running("-c max_connections=20 -c max_locks_per_transaction=10") as pg:
        yield pg


async def _database(pg: OwnPostgres, name: str) -> str:
    async with await psycopg.AsyncConnection.connect(pg.url(), autocommit=True) as conn:
        await conn.execute(f"CREATE DATABASE {name}")
    url = pg.url(name)
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await migrate(conn)
    return url


async def _heads(conn: psycopg.AsyncConnection[Any], endpoint_id: str) -> tuple[int, int]:
    """(deliveries due now, deliveries held) of the endpoint."""
    cur = await conn.execute(
        "SELECT count(*) FILTER (WHERE hold IS NULL AND created_at <= now()),"
        " count(*) FILTER (WHERE hold IS NOT NULL)"
        " FROM webhook_outbox WHERE endpoint_id = %s AND NOT processed",
        (endpoint_id,),
    )
    row = await cur.fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


async def _parked_streams(conn: psycopg.AsyncConnection[Any], streams: int) -> str:
    """An ordered endpoint of tenant acme, disabled, with one parked delivery in each of
    ``streams`` streams (routed as a dispatcher's batches route them). Returns its id."""
    endpoint, _ = await endpoints.create(
        conn, url="http://127.0.0.1:9/h", tenant="acme", ordered=True, allowed_networks=LOOPBACK
    )
    await endpoints.disable(conn, endpoint.id)
    await conn.execute(
        "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload)"
        " SELECT 'acme', 's-' || n, 'order.paid', jsonb_build_object('n', n)"
        " FROM generate_series(1, %s) AS n",
        (streams,),
    )
    while True:
        async with conn.transaction():
            events = await claim_due(conn, 100)
            if not events:
                break
            routed = [Completion(e.id, Outcome.ROUTED) for e in events]
            parts = {e.id: e.partition_at for e in events}
            await complete(conn, routed, parts, route=[e.id for e in events])
    assert await _heads(conn, endpoint.id) == (0, streams)
    return endpoint.id


async def test_enabling_an_endpoint_with_thousands_of_parked_streams(
    small_locks: OwnPostgres,
) -> None:
    """Every stream's head is due when the enable returns, and nothing failed."""
    url = await _database(small_locks, "enable_many")
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        endpoint_id = await _parked_streams(conn, STREAMS)
        enabled = await endpoints.enable(conn, endpoint_id)
        assert enabled.state == "enabled"
        due, held = await _heads(conn, endpoint_id)
        assert (due, held) == (STREAMS, 0)


async def test_an_enable_whose_choice_of_heads_fails_is_an_enable_all_the_same(
    small_locks: OwnPostgres, caplog: pytest.LogCaptureFixture
) -> None:
    """The enable is committed before the heads are chosen: if choosing fails (here one
    stream's lock held elsewhere past the statement timeout), the enable still succeeds
    and says so (an enable asked again changes nothing: it used to raise, unaudited, and
    a retry did nothing), the other chunks' heads are chosen, and the sweep chooses the
    rest once the lock is free."""
    url = await _database(small_locks, "enable_fails")
    streams = PROMOTE_CHUNK + 44
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        endpoint_id = await _parked_streams(conn, streams)
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as holder:
            await holder.execute(  # the key webhook_promote_heads locks, of stream s-1
                "SELECT pg_advisory_lock(hashtextextended(%s || chr(31) || 's-1', 1718973816))",
                (endpoint_id,),
            )
            await conn.execute("SET statement_timeout = '500ms'")
            with caplog.at_level(logging.WARNING, logger="fluxora_webhooks"):
                enabled, changed = await endpoints.enable_once(conn, endpoint_id)
            assert (enabled.state, changed) == ("enabled", True)
            assert "the dispatchers' sweep chooses them" in caplog.text
            # The chunk with s-1 (the first, in key order) failed; the second's are due.
            assert await _heads(conn, endpoint_id) == (44, PROMOTE_CHUNK)
        await conn.execute("RESET statement_timeout")
        assert await dispatcher_module._sweep(conn) == PROMOTE_CHUNK
        assert await _heads(conn, endpoint_id) == (streams, 0)


async def test_a_dispatchers_transaction_takes_a_bounded_number_of_stream_locks(
    small_locks: OwnPostgres,
) -> None:
    """Routing locks at most MAX_STREAM_LOCKS streams, and so does choosing heads in the
    completion; the others are left to the choice after the commit (as if another
    transaction held them). Below the lock table, so nothing fails."""
    url = await _database(small_locks, "routing_many")
    pairs = [(f"ep_{i % 10}", f"s-{i}") for i in range(STREAMS)]
    async with await psycopg.AsyncConnection.connect(url) as conn:
        locked = await try_lock_streams(conn, pairs)
        assert len(locked) == MAX_STREAM_LOCKS
        promoted, busy = await try_promote_heads(conn, pairs)
        assert promoted == 0  # no stream has a delivery here
        assert len(busy) == STREAMS - MAX_STREAM_LOCKS
        cur = await conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
        )
        assert await cur.fetchone() == (MAX_STREAM_LOCKS,)  # the same streams both times
        await conn.rollback()
        # Chosen after the commit, on an idle connection: in transactions of their own.
        await conn.set_autocommit(True)
        assert await promote_heads(conn, busy) == 0


async def test_the_streams_handed_over_after_commits_are_chosen_on_one_connection(
    database_url: str,
) -> None:
    """Streams whose heads a batch left to after its commit (held elsewhere, or past its
    cap) are chosen by one task at a time, on one pool connection: one task per batch
    held the pool's connections waiting for locks, and the batches' detached attempts
    found none to be recorded with (sent again). Every handed-over stream gets its head."""
    from psycopg_pool import AsyncConnectionPool

    from fluxora_webhooks.dispatcher import Dispatcher
    from tests.support.dispatch import make_settings

    streams = 600
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        endpoint_id = await _parked_streams(conn, streams)
        # Enabled by hand: the streams wait with no head, as a batch leaves them.
        await conn.execute(
            "UPDATE webhook_endpoints SET state = 'enabled', disabled_reason = NULL WHERE id = %s",
            (endpoint_id,),
        )
        await conn.execute("UPDATE webhook_outbox SET hold = 'waiting' WHERE hold = 'parked'")
        assert await _heads(conn, endpoint_id) == (0, streams)
        d = Dispatcher(make_settings("", allowed_networks=LOOPBACK), conninfo=database_url)
        pool = AsyncConnectionPool(
            database_url, min_size=1, max_size=4, kwargs={"autocommit": True}, open=False
        )
        await pool.open()
        d._pool = pool
        busy, most = 0, 0
        given = d.with_connection

        async def counted(work: Any) -> Any:
            nonlocal busy, most
            busy += 1
            most = max(most, busy)
            try:
                return await given(work)
            finally:
                busy -= 1

        d.with_connection = counted  # type: ignore[method-assign]
        try:
            for start in range(0, streams, 100):  # six batches' hand-overs, at once
                d.promote_busy([(endpoint_id, f"s-{n}") for n in range(start + 1, start + 101)])
            assert len(d._promotions) == 1
            await asyncio.gather(*d._promotions)
        finally:
            await pool.close()
        assert most == 1
        assert await _heads(conn, endpoint_id) == (streams, 0)
