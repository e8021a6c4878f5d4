"""A claim loop that keeps claiming full batches resumes after its last batch instead of
walking the dead index entries its earlier batches left, and still finds, at its next claim
from the start, a row that became claimable behind that position. The loops of one process
share a front: a resumed claim starts after the rows its sibling loops hold rather than
walking past them, and a batch rolled back clears it."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest

from fluxora_webhooks.batch import FULL_CLAIM_EVERY_S, Batch, ClaimFront, Resume
from fluxora_webhooks.dispatcher import Dispatcher
from fluxora_webhooks.outbox import _claim_sql, claim_due
from tests.support.dispatch import (
    enqueue_many,
    make_settings,
    running_dispatcher,
    scalar,
    wait_until,
)

pytestmark = pytest.mark.integration

BATCH = 10


async def _connect(url: str) -> psycopg.AsyncConnection[Any]:
    return await psycopg.AsyncConnection.connect(url, autocommit=True)


async def _pending(conn: psycopg.AsyncConnection[Any], n: int) -> None:
    """``n`` events in one producer transaction (so with one created_at)."""
    await conn.execute(
        "INSERT INTO webhook_outbox (stream_id, event_type, payload)"
        " SELECT 's' || g, 'e', '{}'::jsonb FROM generate_series(1, %s) g",
        (n,),
    )


async def _claim_and_complete(conn: psycopg.AsyncConnection[Any], resume: Resume) -> list[int]:
    """One batch as the dispatcher runs it: claim (moving the process's front), mark
    processed, commit, then move the loop's position."""
    async with conn.transaction():
        after = resume.position()
        rows = await claim_due(conn, BATCH, after=after)
        resume.front.advance(after, rows, BATCH)
        await conn.execute(
            "UPDATE webhook_outbox SET processed = true WHERE id = ANY(%s)",
            ([r.id for r in rows],),
        )
    resume.claimed(rows, BATCH)
    return [r.id for r in rows]


async def _buffers(conn: psycopg.AsyncConnection[Any], sql: str, params: dict[str, Any]) -> int:
    async with conn.transaction():
        cur = await conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql, params)
        row = await cur.fetchone()
    assert row is not None
    plan = (row[0] if isinstance(row[0], list) else json.loads(row[0]))[0]["Plan"]
    return int(plan.get("Shared Hit Blocks", 0) + plan.get("Shared Read Blocks", 0))


async def test_a_full_batch_is_followed_by_a_claim_after_it(database_url: str) -> None:
    async with await _connect(database_url) as conn:
        # One producer transaction: every row has the same created_at, so the position must
        # be (created_at, id), not created_at alone.
        await _pending(conn, 35)
        resume = Resume()
        first = await _claim_and_complete(conn, resume)
        assert len(first) == BATCH and resume.after is not None
        assert resume.after[1] == first[-1]
        second = await _claim_and_complete(conn, resume)
        assert min(second) > max(first) and len(second) == BATCH
        await _claim_and_complete(conn, resume)
        last = await _claim_and_complete(conn, resume)
        assert len(last) == 5
        assert resume.after is None, "a partial batch: the next claim starts from the start"


async def test_a_row_claimable_behind_the_position_is_found_by_the_next_claim_from_the_start(
    database_url: str,
) -> None:
    async with await _connect(database_url) as conn:
        await _pending(conn, 40)
        resume = Resume()
        await _claim_and_complete(conn, resume)
        # A producer whose transaction began before those rows were written commits now
        # (its created_at is its transaction's start): behind the loop's position.
        cur = await conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload, created_at)"
            " VALUES ('late', 'e', '{}', now() - interval '1 minute') RETURNING id"
        )
        got = await cur.fetchone()
        assert got is not None
        late = int(got[0])
        resumed = await _claim_and_complete(conn, resume)
        assert late not in resumed, "the resumed claim looks only after the position"
        # The time for a claim from the start comes (FULL_CLAIM_EVERY_S), without waiting
        # for it: the loop's last claim from the start is moved back.
        resume.full_at -= 2 * FULL_CLAIM_EVERY_S
        again = await _claim_and_complete(conn, resume)
        assert again[0] == late, "the claim from the start finds the late row first"


async def test_a_batch_rolled_back_leaves_the_position_before_its_rows(database_url: str) -> None:
    async with await _connect(database_url) as conn:
        await _pending(conn, 30)
        resume = Resume()
        first = await _claim_and_complete(conn, resume)
        before = resume.after
        with pytest.raises(RuntimeError):
            async with conn.transaction():
                rows = await claim_due(conn, BATCH, after=resume.position())
                raise RuntimeError("the batch failed")
        assert resume.after == before  # Batch.run moves it only after the commit
        retried = await _claim_and_complete(conn, resume)
        assert retried == [r.id for r in rows]
        assert min(retried) > max(first)


async def test_the_resumed_claim_skips_the_dead_entries_of_earlier_batches(
    database_url: str,
) -> None:
    async with await _connect(database_url) as conn:
        # Nothing removes the dead entries during the test: the state of a burst between
        # two visits of autovacuum.
        await conn.execute("ALTER TABLE webhook_outbox SET (autovacuum_enabled = false)")
        await _pending(conn, 20000)
        resume = Resume()
        for _ in range(1500):
            await _claim_and_complete(conn, resume)
        assert resume.after is not None
        at, after_id = resume.after
        params = {"batch": BATCH, "since": None, "after_at": at, "after_id": after_id}
        full = await _buffers(conn, _claim_sql("claim_due", batch=BATCH, resumed=False), params)
        resumed = await _buffers(conn, _claim_sql("claim_due", batch=BATCH, resumed=True), params)
        # 15,000 completed rows lie before the position.
        assert resumed * 5 < full, f"resumed claim read {resumed} pages, from the start {full}"
        assert resumed < 50, f"resumed claim read {resumed} pages"


async def _hold(conn: psycopg.AsyncConnection[Any], front: ClaimFront) -> list[int]:
    """A sibling loop's batch in flight: claimed in an open transaction, the front moved as
    Batch.run moves it."""
    await conn.execute("BEGIN")
    rows = await claim_due(conn, BATCH)
    front.advance(None, rows, BATCH)  # a claim from the start
    return [r.id for r in rows]


async def test_a_resumed_claim_starts_after_the_rows_its_sibling_loops_hold(
    database_url: str,
) -> None:
    front = ClaimFront()
    async with await _connect(database_url) as conn:
        await _pending(conn, 200)
        resume = Resume(front=front)
        first = await _claim_and_complete(conn, resume)
        siblings = [await _connect(database_url) for _ in range(8)]
        try:
            held = [await _hold(sibling, front) for sibling in siblings]
            assert front.at is not None and front.at[1] == held[-1][-1]
            assert resume.position() == front.at, "the front is further than the loop's own"
            at, after_id = front.at
            own_at, own_id = resume.after or (at, after_id)
            by_front = {"since": None, "after_at": at, "after_id": after_id}
            by_own = {"since": None, "after_at": own_at, "after_id": own_id}
            sql = _claim_sql("claim_due", batch=BATCH, resumed=True)
            # Without the front the claim visits the 80 rows the siblings hold (SKIP LOCKED
            # skips each one only after reading it); with it, it starts after them.
            walked = await _buffers(conn, sql, by_own)
            skipped = await _buffers(conn, sql, by_front)
            assert skipped * 3 < walked, f"from the front {skipped} pages, past them {walked}"
            mine = await _claim_and_complete(conn, resume)
            assert min(mine) > max(held[-1]) and len(mine) == BATCH
            assert min(held[0]) > max(first)
        finally:
            for sibling in siblings:
                await sibling.close()  # their batches roll back


async def test_a_batch_rolled_back_clears_the_front_so_its_rows_are_claimed_again(
    database_url: str,
) -> None:
    dispatcher = Dispatcher(make_settings("http://127.0.0.1:9/x"), conninfo=database_url)
    async with await _connect(database_url) as conn:
        await _pending(conn, 60)
        resume = Resume(front=dispatcher.claim_front)
        await _claim_and_complete(conn, resume)
        async with await _connect(database_url) as sibling:
            lost = await _hold(sibling, dispatcher.claim_front)
            await sibling.execute("ROLLBACK")
        dispatcher.after_rollback(Batch(dispatcher))
        assert dispatcher.claim_front.at is None
        again = await _claim_and_complete(conn, resume)
        assert again == lost, "the rolled-back rows come first, not after the old front"


async def test_rows_a_claim_from_the_start_finds_behind_the_front_are_walked_in_order(
    database_url: str,
) -> None:
    front = ClaimFront()
    async with await _connect(database_url) as conn:
        await _pending(conn, 100)
        sibling = Resume(front=front)
        done = [await _claim_and_complete(conn, sibling) for _ in range(5)]
        assert front.at is not None and front.at[1] == done[-1][-1]
        # Thirty rows claimable behind the front (a producer's transaction that began
        # earlier, an enable's resumed rows); nobody holds them.
        cur = await conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload, created_at)"
            " SELECT 'late', 'e', '{}', now() - interval '1 minute'"
            " FROM generate_series(1, 30) RETURNING id"
        )
        late = sorted(int(r[0]) for r in await cur.fetchall())
        loop = Resume(front=front)
        claimed = [await _claim_and_complete(conn, loop) for _ in range(3)]
        # The first, from the start, found them; the next two go on through them instead
        # of jumping to the front the siblings' batches left.
        assert [id_ for batch in claimed for id_ in batch] == late
        assert front.at is not None and front.at[1] == late[-1]
        rest = await _claim_and_complete(conn, sibling)
        assert min(rest) > max(done[-1]), "a loop ahead keeps its own position"


async def test_the_dispatchers_loops_move_their_shared_front(database_url: str) -> None:
    await enqueue_many(database_url, 300)
    settings = make_settings("http://127.0.0.1:9/x", claim_loops=3)
    async with running_dispatcher(settings, database_url) as dispatcher:
        loops = dispatcher.claim_front

        async def done() -> bool:
            left = await scalar(
                database_url,
                "SELECT count(*) FROM webhook_outbox WHERE attempt = 1 AND NOT processed",
            )
            return bool(left == 0)

        await wait_until(done, what="every row attempted once")
    # A full batch's last row, as a claim of the loops returned it.
    assert loops.at is not None
    at, last = loops.at
    assert (
        await scalar(database_url, "SELECT created_at FROM webhook_outbox WHERE id = %s", (last,))
        == at
    )
