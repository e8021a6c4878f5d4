"""Retention: prune deletes old history in short batches, beside a working dispatcher, and
never touches a pending row or a dead letter still waiting."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import psycopg
import pytest

from fluxora_webhooks import metrics
from fluxora_webhooks.outbox import enqueue
from fluxora_webhooks.queries import query
from fluxora_webhooks.retention import RETENTION_LOCK_KEY, prune
from fluxora_webhooks.service import Service
from tests.support.dispatch import make_settings, rows, running_dispatcher, scalar, wait_until
from tests.support.procs import command_env, run_command
from tests.support.receiver import Receiver

pytestmark = pytest.mark.integration

DAY_MS = 86_400_000
WEEK_MS = 7 * DAY_MS
OLD = 150_000
RECENT = 50_000


async def _connect(url: str) -> psycopg.AsyncConnection[Any]:
    return await psycopg.AsyncConnection.connect(url, autocommit=True)


async def _seed_history(database_url: str, old: int, recent: int) -> None:
    """Processed rows: ``old`` processed 8 to 30 days ago, ``recent`` within the last day."""
    async with await _connect(database_url) as conn:
        await conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload, created_at, processed,"
            " processed_at, outcome, status_code, duration_ms)"
            " SELECT 'old-' || g, 'stream.updated', jsonb_build_object('g', g),"
            "   now() - interval '30 days', true,"
            "   now() - interval '8 days' - mod(g, 20) * interval '1 day', 'delivered', 200, 1.5"
            " FROM generate_series(1, %s) g",
            (old,),
        )
        await conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload, created_at, processed,"
            " processed_at, outcome, status_code, duration_ms)"
            " SELECT 'recent-' || g, 'stream.updated', jsonb_build_object('g', g),"
            "   now() - interval '2 days', true,"
            "   now() - interval '1 day' + mod(g, 1000) * interval '1 second',"
            "   CASE WHEN mod(g, 10) = 0 THEN 'retry' ELSE 'delivered' END, 200, 1.5"
            " FROM generate_series(1, %s) g",
            (recent,),
        )


async def _seed_untouchables(database_url: str) -> None:
    """Rows that must survive any prune: pending rows due later (one with a bogus old
    processed_at, as if written by hand), and dead letters still waiting."""
    async with await _connect(database_url) as conn:
        await conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload, created_at, enqueued_at)"
            " SELECT 'future-' || g, 'stream.updated', '{}'::jsonb,"
            "   now() + interval '1 day', now() - interval '60 days'"
            " FROM generate_series(1, 20) g"
        )
        await conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload, created_at, processed,"
            " processed_at, outcome)"
            " VALUES ('trap', 'stream.updated', '{}'::jsonb, now() + interval '1 day', false,"
            "   now() - interval '60 days', NULL)"
        )
        await conn.execute(
            "INSERT INTO webhook_dead_letter (delivery_id, stream_id, event_type, payload,"
            " attempts, reason, enqueued_at, dead_at, state, state_changed_at)"
            " SELECT gen_random_uuid(), s || '-' || g, 'stream.updated', '{}'::jsonb, 8,"
            "   'attempts_exhausted', now() - interval '40 days', now() - interval '40 days',"
            "   s, CASE WHEN s = 'dead' THEN NULL ELSE now() - changed * interval '1 day' END"
            " FROM generate_series(1, 5) g,"
            "   (VALUES ('dead', 0), ('replayed', 10), ('purged', 10), ('replayed', 1))"
            "   AS v(s, changed)"
        )


async def _count(database_url: str, where: str) -> int:
    return int(await scalar(database_url, f"SELECT count(*) FROM webhook_outbox WHERE {where}"))


@pytest.mark.slow
async def test_prune_beside_a_working_dispatcher(database_url: str, receiver: Receiver) -> None:
    await _seed_history(database_url, OLD, RECENT)
    await _seed_untouchables(database_url)
    async with await _connect(database_url) as conn:
        await conn.execute("ANALYZE webhook_outbox")
        # The backlog reading the service does every few seconds stays on the partial
        # index, however many processed rows sit in the table.
        cur = await conn.execute(
            "EXPLAIN (FORMAT JSON) " + query("backlog"), {"cap": 100_000}, prepare=False
        )
        plan = json.dumps((await cur.fetchone())[0])  # type: ignore[index]
        assert "Seq Scan" not in plan, plan
        assert "webhook_outbox_due_idx" in plan

    delivered_ids: list[str] = []
    settings = make_settings(receiver.url, batch_size=20)
    async with running_dispatcher(settings, database_url):
        async with await _connect(database_url) as prune_conn:
            pruning = asyncio.create_task(
                prune(prune_conn, older_than_ms=WEEK_MS, dead_letters=True, batch_size=5000)
            )
            # Producers keep enqueueing (and the dispatcher delivering) during the prune.
            async with await psycopg.AsyncConnection.connect(database_url) as producer:
                while not pruning.done() or len(delivered_ids) < 200:
                    async with producer.transaction():
                        delivered_ids.append(
                            await enqueue(
                                producer,
                                stream_id=f"new-{len(delivered_ids)}",
                                event_type="stream.created",
                                payload={"n": len(delivered_ids)},
                            )
                        )
                    await asyncio.sleep(0.002)
            result = await asyncio.wait_for(pruning, 120)
        await receiver.wait_for(len(delivered_ids), timeout=60)
        await wait_until(
            lambda: _no_due_rows(database_url), timeout=30, what="new events delivered"
        )

    # Every new event was delivered, once, and its attempt row is still there.
    assert {r.delivery_id for r in receiver.received} == set(delivered_ids)
    assert await _count(database_url, "stream_id LIKE 'new-%' AND outcome = 'delivered'") == len(
        delivered_ids
    )
    # The old history is gone, in bounded batches; the last week's history stays.
    assert result.outbox_rows == OLD
    assert result.batches >= OLD // 5000
    assert await _count(database_url, "stream_id LIKE 'old-%'") == 0
    assert await _count(database_url, "stream_id LIKE 'recent-%'") == RECENT
    # Pending rows are never touched, whatever their timestamps say.
    assert await _count(database_url, "NOT processed") == 21
    assert await _count(database_url, "stream_id = 'trap' AND NOT processed") == 1
    # Dead letters: only the settled ones older than the period went.
    assert result.dead_letters == 10
    left = await rows(
        database_url,
        "SELECT state, count(*) FROM webhook_dead_letter GROUP BY state ORDER BY state",
    )
    assert left == [("dead", 5), ("replayed", 5)]


async def _no_due_rows(database_url: str) -> bool:
    return await _count(database_url, "NOT processed AND created_at <= now()") == 0


async def test_prune_skips_rows_another_transaction_holds(database_url: str) -> None:
    await _seed_history(database_url, 300, 10)
    async with await psycopg.AsyncConnection.connect(database_url) as holder:
        await holder.execute("BEGIN")
        cur = await holder.execute(
            "SELECT id FROM webhook_outbox WHERE stream_id = 'old-7' FOR UPDATE"
        )
        (held,) = await cur.fetchone()  # type: ignore[misc]
        async with await _connect(database_url) as conn:
            # Does not wait for the lock (the timeout only guards the test run).
            result = await asyncio.wait_for(
                prune(conn, older_than_ms=WEEK_MS, batch_size=50), timeout=60
            )
        assert result.outbox_rows == 299
        assert await _count(database_url, f"id = {held}") == 1
        await holder.execute("ROLLBACK")
    async with await _connect(database_url) as conn:
        again = await prune(conn, older_than_ms=WEEK_MS, batch_size=50)
    assert again.outbox_rows == 1
    assert await _count(database_url, "stream_id LIKE 'old-%'") == 0
    assert await _count(database_url, "stream_id LIKE 'recent-%'") == 10


async def test_dry_run_counts_and_deletes_nothing(database_url: str) -> None:
    await _seed_history(database_url, 40, 15)
    await _seed_untouchables(database_url)
    async with await _connect(database_url) as conn:
        result = await prune(conn, older_than_ms=WEEK_MS, dead_letters=True, dry_run=True)
    assert (result.outbox_rows, result.dead_letters, result.dry_run) == (40, 10, True)
    assert await _count(database_url, "true") == 40 + 15 + 21


async def test_an_exclusive_prune_is_skipped_while_another_runs(database_url: str) -> None:
    await _seed_history(database_url, 10, 0)
    async with await _connect(database_url) as other, await _connect(database_url) as conn:
        await other.execute("SELECT pg_advisory_lock(%s)", (RETENTION_LOCK_KEY,))
        skipped = await prune(conn, older_than_ms=WEEK_MS, exclusive=True)
        assert skipped.skipped and skipped.outbox_rows == 0
        await other.execute("SELECT pg_advisory_unlock(%s)", (RETENTION_LOCK_KEY,))
        done = await prune(conn, older_than_ms=WEEK_MS, exclusive=True)
    assert not done.skipped and done.outbox_rows == 10


async def test_a_prune_command_that_waits_for_the_lock_says_whose_it_may_be(
    database_url: str,
) -> None:
    """`prune` takes the retention lock for its whole run, waiting for it when another
    holds it: another `prune` as often as a dispatcher with WEBHOOK_RETENTION (the lock
    does not say which). Its message names both, not a dispatcher only; once the lock is
    free it prunes."""
    await _seed_history(database_url, 10, 0)
    env = command_env(DATABASE_URL=database_url)
    async with await _connect(database_url) as other:
        await other.execute("SELECT pg_advisory_lock(%s)", (RETENTION_LOCK_KEY,))
        command = asyncio.create_task(run_command("prune", "--older-than", "7d", env=env))
        try:
            await wait_until(
                lambda: _waits_for_the_retention_lock(database_url),
                timeout=30,
                what="prune waiting for the lock",
            )
        finally:
            await other.execute("SELECT pg_advisory_unlock(%s)", (RETENTION_LOCK_KEY,))
        code, out = await command
    assert code == 0, out
    assert (
        "waiting for another retention run on this database to end (a prune command, or a"
        " dispatcher with WEBHOOK_RETENTION)"
    ) in out, out
    assert "deleted 10 processed outbox row(s)" in out, out


async def _waits_for_the_retention_lock(database_url: str) -> bool:
    """A session waits for the retention lock (a bigint key: its high and low halves)."""
    return bool(
        await scalar(
            database_url,
            # This database's: another test's dispatcher may wait for the same key in its own.
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory'"
            " AND NOT granted AND classid::bigint = %s AND objid::bigint = %s"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database()))",
            (RETENTION_LOCK_KEY >> 32, RETENTION_LOCK_KEY & 0xFFFFFFFF),
        )
    )


def _sample(name: str, labels: dict[str, str]) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


async def test_run_prunes_when_webhook_retention_is_set(
    database_url: str, receiver: Receiver
) -> None:
    await _seed_history(database_url, 500, 30)
    await _seed_untouchables(database_url)
    deleted = "fluxora_webhook_retention_deleted_rows_total"
    before = {t: _sample(deleted, {"table": t}) for t in ("outbox", "dead_letter")}
    settings = dataclasses.replace(make_settings(receiver.url), retention_ms=WEEK_MS)
    service = Service(settings, database_url=database_url, redis_url=None)
    task = asyncio.create_task(service.run(install_signals=False))

    async def counted() -> bool:
        return (
            _sample(deleted, {"table": "outbox"}) - before["outbox"] == 500
            and _sample(deleted, {"table": "dead_letter"}) - before["dead_letter"] == 10
        )

    try:
        await wait_until(counted, timeout=30, what="the start-up retention run")
    finally:
        service.stop()
        await asyncio.wait_for(task, 30)
    assert await _count(database_url, "stream_id LIKE 'old-%'") == 0
    assert await _count(database_url, "stream_id LIKE 'recent-%'") == 30
    assert await _count(database_url, "NOT processed") == 21
    left = await rows(
        database_url,
        "SELECT state, count(*) FROM webhook_dead_letter GROUP BY state ORDER BY state",
    )
    assert left == [("dead", 5), ("replayed", 5)]
