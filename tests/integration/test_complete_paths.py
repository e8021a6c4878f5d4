"""Recording a batch: the statement without the parts a batch has nothing for writes what
the whole statement writes; only rows still pending are written; the rows are found by
their key however the statistics see the backlog; and the claim keeps one plan (its batch
size is part of its text, not a parameter PostgreSQL plans for each time)."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest

from fluxora_webhooks import endpoints, outbox, partitions
from fluxora_webhooks.deliveries import get_delivery
from fluxora_webhooks.delivery import EGRESS_HELD
from fluxora_webhooks.outbox import (
    Claimed,
    Completion,
    Outcome,
    claim_due,
    complete,
    complete_statement,
)
from tests.integration.test_plans_many import explain

pytestmark = pytest.mark.integration

# Every column a completion writes.
WRITTEN = (
    "processed, processed_at IS NOT NULL, outcome, endpoint_id, status_code, error,"
    " response_body, duration_ms, lease, created_at, hold, attempt"
)


async def _connect(url: str) -> psycopg.AsyncConnection[Any]:
    return await psycopg.AsyncConnection.connect(url, autocommit=True)


async def _events(conn: psycopg.AsyncConnection[Any], n: int) -> None:
    await conn.execute(
        "INSERT INTO webhook_outbox (stream_id, event_type, payload)"
        " SELECT 's' || g, 'stream.created', jsonb_build_object('n', g)"
        " FROM generate_series(1, %s) g",
        (n,),
    )


def _delivered(rows: list[Claimed]) -> list[Completion]:
    """Outcomes as a batch records them: event rows delivered as the default endpoint's
    deliveries, with a response body on some and a duration on all."""
    return [
        Completion(
            r.id,
            Outcome.DELIVERED,
            status_code=200 + i % 3,
            response_body="ok" if i % 2 else None,
            duration_ms=1.5 * i,
            endpoint_id="default",
        )
        for i, r in enumerate(rows)
    ]


async def _written(conn: psycopg.AsyncConnection[Any], ids: list[int]) -> list[tuple[Any, ...]]:
    cur = await conn.execute(
        f"SELECT {WRITTEN} FROM webhook_outbox WHERE id = ANY(%s) ORDER BY id", (ids,)
    )
    return await cur.fetchall()


# Outcome mixes of a batch of five event rows (delivered as the default endpoint's
# deliveries, or routed), each taking a different set of the statement's parts.
MIXES = {
    "delivered": [Outcome.DELIVERED] * 5,
    "routed": [Outcome.ROUTED] * 5,
    "retry": [Outcome.DELIVERED, Outcome.RETRY, Outcome.DELIVERED, Outcome.RETRY, Outcome.RETRY],
    # Failures only: the endpoint's failure streak starts.
    "dead": [
        Outcome.DEAD_LETTER,
        Outcome.RETRY,
        Outcome.DEAD_LETTER,
        Outcome.DEFERRED,
        Outcome.DEAD_LETTER,
    ],
    "held": [Outcome.DEFERRED, Outcome.PARKED, Outcome.DEFERRED, Outcome.PARKED, Outcome.PARKED],
    "every": [
        Outcome.DELIVERED,
        Outcome.RETRY,
        Outcome.DEAD_LETTER,
        Outcome.DEFERRED,
        Outcome.PARKED,
    ],
}


def _outcomes(rows: list[Claimed], mix: list[Outcome]) -> list[Completion]:
    return [
        Completion(
            r.id,
            outcome,
            status_code=None if outcome in (Outcome.DEFERRED, Outcome.PARKED) else 500 + i,
            error="boom" if outcome is Outcome.RETRY else None,
            response_body="no" if i % 2 else None,
            duration_ms=1.5 * i,
            delay_ms=60_000,
            reason="exhausted" if outcome is Outcome.DEAD_LETTER else None,
            endpoint_id=None if outcome is Outcome.ROUTED else "default",
        )
        for i, (r, outcome) in enumerate(zip(rows, mix, strict=True))
    ]


async def _record_mix(
    conn: psycopg.AsyncConnection[Any], mix: list[Outcome], *, general: bool
) -> tuple[list[int], int]:
    """Claim five event rows, record them with ``mix`` by the whole statement
    (``general``) or by the one for this batch; the ids and how many parts it dropped."""
    async with conn.transaction():
        rows = await claim_due(conn, 5)
        assert len(rows) == 5
        completions = _outcomes(rows, mix)
        failed = ["default"] if {Outcome.RETRY, Outcome.DEAD_LETTER} & set(mix) else []
        succeeded = ["default"] if Outcome.DELIVERED in mix else []
        text, params = complete_statement(
            completions,
            {r.id: r.partition_at for r in rows},
            route=[r.id for r in rows] if Outcome.ROUTED in mix else [],
            succeeded=succeeded,
            failed=failed,
            general=general,
        )
        cur = psycopg.AsyncRawCursor(conn)
        await cur.execute(text, params)
    return [r.id for r in rows], text.count("WHERE false")


async def _what_was_written(
    conn: psycopg.AsyncConnection[Any], ids: list[int]
) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]], list[tuple[Any, ...]], Any]:
    """The rows' written columns (times as whether they moved), the retries and dead
    letters they made, and the default endpoint's failure streak."""
    of_ids = [
        # The rows themselves.
        "SELECT processed, processed_at IS NOT NULL, outcome, endpoint_id, status_code,"
        " error, response_body, duration_ms, lease, created_at > now() + interval '30 s',"
        " created_at = 'infinity', hold, attempt, deferrals"
        " FROM webhook_outbox o WHERE id = ANY(%s) ORDER BY id",
        # Their retries.
        "SELECT r.attempt, r.endpoint_id, r.created_at > now() + interval '30 s'"
        " FROM webhook_outbox r JOIN webhook_outbox o ON r.delivery_id = o.delivery_id"
        " AND r.attempt = o.attempt + 1 WHERE o.id = ANY(%s) ORDER BY o.id",
        # Their dead letters.
        "SELECT d.reason, d.last_status, d.endpoint_id FROM webhook_dead_letter d"
        " JOIN webhook_outbox o ON o.delivery_id = d.delivery_id"
        " WHERE o.id = ANY(%s) ORDER BY o.id",
    ]
    found = []
    for sql in of_ids:
        cur = await conn.execute(sql, (ids,))
        found.append(await cur.fetchall())
    rows, retries, dead = found
    cur = await conn.execute(
        "SELECT failing_since IS NOT NULL FROM webhook_endpoints WHERE id = 'default'"
    )
    streak = await cur.fetchone()
    # Ready for the next batch: the streak as the first batch found it.
    await conn.execute("UPDATE webhook_endpoints SET failing_since = NULL WHERE id = 'default'")
    return rows, retries, dead, streak


@pytest.mark.parametrize("partitioned", [False, True], ids=["plain", "partitioned"])
@pytest.mark.parametrize("mix", list(MIXES), ids=str)
async def test_a_batch_is_written_without_its_empty_parts_as_the_whole_statement_writes_it(
    database_url: str, partitioned: bool, mix: str
) -> None:
    async with await _connect(database_url) as conn:
        if partitioned:
            assert await partitions.convert(conn, interval_ms=86_400_000) is True
        # The default endpoint as a running service configures it; and a tenant endpoint
        # of the default tenant, so that routed event rows get a delivery.
        await conn.execute(
            "INSERT INTO webhook_endpoints (id, tenant, url)"
            " VALUES ('default', '', 'https://example.com/h')"
        )
        await endpoints.create(conn, url="https://example.com/t", tenant="")
        await _events(conn, 10)
        whole, dropped = await _record_mix(conn, MIXES[mix], general=True)
        assert dropped == 0
        by_whole = await _what_was_written(conn, whole)
        lean, dropped = await _record_mix(conn, MIXES[mix], general=False)
        assert dropped >= 1, "every batch here leaves some part out"
        by_lean = await _what_was_written(conn, lean)
    assert by_lean == by_whole
    rows, retries, dead, streak = by_lean
    # What each mix is about was written at all (the comparison is not of two empty sets).
    assert len(retries) == MIXES[mix].count(Outcome.RETRY)
    assert len(dead) == MIXES[mix].count(Outcome.DEAD_LETTER)
    assert sum(r[11] == "parked" for r in rows) == MIXES[mix].count(Outcome.PARKED)
    assert sum(r[2] == "routed" for r in rows) == MIXES[mix].count(Outcome.ROUTED)
    # A failure starts a streak, unless the same batch had a success.
    failures = {Outcome.RETRY, Outcome.DEAD_LETTER} & set(MIXES[mix])
    assert streak == (bool(failures) and Outcome.DELIVERED not in MIXES[mix],)


async def test_the_claim_says_whether_an_event_row_has_an_endpoint_to_be_routed_to(
    database_url: str,
) -> None:
    """An event row of a tenant with no endpoint of its own (the built-in ones do not
    count) is claimed not routable; one of a tenant with an endpoint, created a moment
    before the claim, is routable."""
    async with await _connect(database_url) as conn:
        await conn.execute(
            "INSERT INTO webhook_endpoints (id, tenant, url)"
            " VALUES ('default', '', 'https://example.com/h')"
        )
        await endpoints.create(conn, url="https://example.com/a", tenant="acme")
        for tenant in ("", "acme", ""):
            await conn.execute(
                "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload)"
                " VALUES (%s, 's', 'e', '{}')",
                (tenant,),
            )
        async with conn.transaction():
            rows = await claim_due(conn, 3)
        assert [(r.tenant, r.routable) for r in rows] == [("", False), ("acme", True), ("", False)]
        # Claimed again (nothing was recorded), once the default tenant has an endpoint.
        await endpoints.create(conn, url="https://example.com/b", tenant="")
        async with conn.transaction():
            rows = await claim_due(conn, 3)
        assert [r.routable for r in rows] == [True, True, True]


async def test_a_row_completed_meanwhile_is_not_written_again(database_url: str) -> None:
    """Only rows still pending are written: a row recorded by another transaction keeps
    what that one wrote."""
    async with await _connect(database_url) as conn:
        await _events(conn, 3)
        async with conn.transaction():
            rows = await claim_due(conn, 3)
            await conn.execute(
                "UPDATE webhook_outbox SET processed = true, outcome = 'dead_letter' WHERE id = %s",
                (rows[0].id,),
            )
            recorded = await complete(conn, _delivered(rows), {r.id: r.partition_at for r in rows})
        assert recorded.processed == 2
        found = await _written(conn, [rows[0].id])
        assert found[0][2] == "dead_letter"


async def test_the_claim_keeps_one_plan(database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Executed as the dispatcher executes it (prepared by psycopg after a few runs), the
    claim is planned once: PostgreSQL's generic plan, not a custom plan per batch."""
    monkeypatch.setattr(outbox, "SLOW_CLAIM_S", 60.0)  # no replan on a loaded machine
    async with await _connect(database_url) as conn:
        await _events(conn, 200)
        for _ in range(15):
            async with conn.transaction():
                rows = await claim_due(conn, 10)
                await complete(conn, _delivered(rows), {r.id: r.partition_at for r in rows})
        cur = await conn.execute(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements"
            " WHERE statement LIKE '%%FOR UPDATE SKIP LOCKED%%'"
            "   AND statement LIKE '%%LIMIT 10%%'"
        )
        found = await cur.fetchall()
    assert len(found) == 1, found
    generic, custom = found[0]
    assert custom == 0 and generic >= 5, f"claim: {generic} generic, {custom} custom plans"


async def test_an_endpoint_batch_is_recorded_with_its_endpoint(database_url: str) -> None:
    """Delivery rows of a tenant's endpoint (not the default) through ``complete``: written
    delivered, their endpoint kept."""
    async with await _connect(database_url) as conn:
        endpoint, _ = await endpoints.create(conn, url="https://example.com/h", tenant="acme")
        await conn.execute(
            "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload, endpoint_id)"
            " SELECT 'acme', 's' || g, 'e', '{}'::jsonb, %s FROM generate_series(1, 4) g",
            (endpoint.id,),
        )
        async with conn.transaction():
            rows = await claim_due(conn, 10)
            completions = [
                Completion(r.id, Outcome.DELIVERED, status_code=204, duration_ms=2.0) for r in rows
            ]
            recorded = await complete(
                conn, completions, {r.id: r.partition_at for r in rows}, succeeded=[endpoint.id]
            )
        assert recorded.processed == 4
        found = await _written(conn, [r.id for r in rows])
        assert {(f[0], f[2], f[3], f[4]) for f in found} == {(True, "delivered", endpoint.id, 204)}


async def _wait_reasons(
    conn: psycopg.AsyncConnection[Any], endpoint_id: str
) -> list[tuple[str, str | None]]:
    """Each delivery of the endpoint's (status, wait_reason), as the API reads them."""
    cur = await conn.execute(
        "SELECT DISTINCT delivery_id::text FROM webhook_outbox WHERE endpoint_id = %s",
        (endpoint_id,),
    )
    ids = sorted(str(r[0]) for r in await cur.fetchall())
    found = [await get_delivery(conn, i) for i in ids]
    return [(d["status"], d["wait_reason"]) for d in found]


async def _held_by_the_proxy(conn: psycopg.AsyncConnection[Any]) -> list[Claimed]:
    """Claim every due row and hold it as an egress proxy's outage does (due again at once)."""
    async with conn.transaction():
        rows = await claim_due(conn, 10)
        held = [Completion(r.id, Outcome.DEFERRED, delay_ms=1, error=EGRESS_HELD) for r in rows]
        await complete(conn, held, {r.id: r.partition_at for r in rows})
    await asyncio.sleep(0.01)
    return rows


async def test_a_held_deliverys_wait_reason_goes_when_it_is_parked(database_url: str) -> None:
    """A delivery held by the egress proxy says so; parked since (its endpoint disabled, by
    the next claim or by the disabling itself), it says nothing of the proxy: its status
    says why it waits; due again, nothing old either."""
    async with await _connect(database_url) as conn:
        endpoint, _ = await endpoints.create(conn, url="https://example.com/h", tenant="acme")
        await conn.execute(
            "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload, endpoint_id)"
            " SELECT 'acme', 's' || g, 'e', '{}'::jsonb, %s FROM generate_series(1, 2) g",
            (endpoint.id,),
        )
        rows = await _held_by_the_proxy(conn)
        assert len(rows) == 2
        assert await _wait_reasons(conn, endpoint.id) == [("pending", EGRESS_HELD)] * 2
        # Parked by the next claim's completion (its endpoint found disabled).
        async with conn.transaction():
            rows = await claim_due(conn, 10)
            parked = [Completion(r.id, Outcome.PARKED) for r in rows]
            await complete(conn, parked, {r.id: r.partition_at for r in rows})
        assert await _wait_reasons(conn, endpoint.id) == [("parked", None)] * 2
        await conn.execute(
            "UPDATE webhook_outbox SET hold = NULL, created_at = now() WHERE endpoint_id = %s",
            (endpoint.id,),
        )
        # Parked by the disabling itself, then due again when it is enabled.
        await _held_by_the_proxy(conn)
        await endpoints.disable(conn, endpoint.id)
        assert await _wait_reasons(conn, endpoint.id) == [("parked", None)] * 2
        await endpoints.enable(conn, endpoint.id)
        assert await _wait_reasons(conn, endpoint.id) == [("pending", None)] * 2


@pytest.mark.parametrize("outcome", [Outcome.DELIVERED, Outcome.RETRY], ids=str)
async def test_a_batch_is_recorded_by_key_beside_a_backlog_the_statistics_miss(
    database_url: str, outcome: Outcome
) -> None:
    """The statistics say almost nothing is pending (analyzed over 200,000 processed rows)
    when 20,000 rows are: recording a batch of ten still probes the key for each, rather
    than reading every pending row (the plan it had with "NOT processed")."""
    async with await _connect(database_url) as conn:
        await conn.execute("ALTER TABLE webhook_outbox SET (autovacuum_enabled = false)")
        await conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload, processed,"
            " processed_at, outcome, endpoint_id)"
            " SELECT 's', 'e', '{}', true, now(), 'delivered', 'ep'"
            " FROM generate_series(1, 200000)"
        )
        await conn.execute("ANALYZE webhook_outbox")
        await _events(conn, 20000)
        cur = await conn.execute(
            "SELECT id, partition_at FROM webhook_outbox WHERE NOT processed ORDER BY id LIMIT 10"
        )
        found = {int(r[0]): r[1] for r in await cur.fetchall()}
        statement, params = complete_statement(
            [Completion(i, outcome, status_code=200, delay_ms=1000) for i in found], found
        )
        plan = await explain(conn, statement, params, native=True)
    updates = [n for n in plan.all if n.get("Operation") == "Update"]
    assert updates, "no update in the plan"
    plan.check(uses={"webhook_outbox_pkey"}, max_examined=100)


async def _claim_plan(conn: psycopg.AsyncConnection[Any]) -> str:
    """The plan the connection's prepared claim runs with (its generic plan)."""
    cur = await conn.execute(
        "SELECT name FROM pg_prepared_statements WHERE statement LIKE '%%FOR UPDATE SKIP LOCKED%%'"
    )
    (name,) = await cur.fetchone() or ("",)
    assert name, "the claim is not prepared"
    cur = await conn.execute(f"EXPLAIN EXECUTE {name}")
    return "\n".join(str(r[0]) for r in await cur.fetchall())


async def test_a_claim_planned_on_a_nearly_empty_outbox_is_planned_again_for_a_burst(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim prepared while the outbox held a few rows scans the table and sorts it;
    after a burst, once claims of full batches keep taking long (every one here), the
    connection's statements are planned again: the claim reads the due rows' index."""
    async with await _connect(database_url) as conn:
        for _ in range(8):  # prepared (psycopg) and planned on a table of one row
            await _events(conn, 1)
            async with conn.transaction():
                rows = await claim_due(conn, 10)
                await complete(conn, _delivered(rows), {r.id: r.partition_at for r in rows})
        assert "Seq Scan on webhook_outbox" in await _claim_plan(conn)
        await _events(conn, 20_000)
        monkeypatch.setattr(outbox, "SLOW_CLAIM_S", 0.0, raising=False)
        for _ in range(3 + 8):  # past SLOW_CLAIMS_TO_REPLAN, then prepared again
            async with conn.transaction():
                rows = await claim_due(conn, 10)
                assert len(rows) == 10
                await complete(conn, _delivered(rows), {r.id: r.partition_at for r in rows})
        plan = await _claim_plan(conn)
    assert "webhook_outbox_due_idx" in plan and "Seq Scan on webhook_outbox" not in plan, plan
