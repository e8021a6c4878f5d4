"""The common batch (every row delivered, or an event row already routed) is written by a
statement of its own, ``complete_delivered``: it must write exactly what the general
``complete_batch`` writes, on a plain and on a partitioned outbox. And the claim keeps one
plan: its batch size is part of its text, not a parameter PostgreSQL plans for each time."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest

from fluxora_webhooks import endpoints, partitions
from fluxora_webhooks.outbox import (
    Claimed,
    Completion,
    Outcome,
    claim_due,
    complete,
    complete_statement,
    is_plain,
)

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


async def _record(
    conn: psycopg.AsyncConnection[Any], *, general: bool, succeeded: list[str]
) -> list[int]:
    """Claim a batch, record it delivered with one statement or the other; the ids."""
    async with conn.transaction():
        rows = await claim_due(conn, 5)
        completions = _delivered(rows)
        parts = {r.id: r.partition_at for r in rows}
        text, params = complete_statement(completions, parts, succeeded=succeeded, general=general)
        assert ("retried AS" in text) == general
        cur = psycopg.AsyncRawCursor(conn)
        await cur.execute(text, params)
    return [r.id for r in rows]


@pytest.mark.parametrize("partitioned", [False, True], ids=["plain", "partitioned"])
async def test_a_delivered_batch_is_written_as_the_general_statement_writes_it(
    database_url: str, partitioned: bool
) -> None:
    async with await _connect(database_url) as conn:
        if partitioned:
            assert await partitions.convert(conn, interval_ms=86_400_000) is True
        # The default endpoint as a running service configures it, failing.
        await conn.execute(
            "INSERT INTO webhook_endpoints (id, tenant, url, failing_since)"
            " VALUES ('default', '', 'https://example.com/h', now())"
        )
        await _events(conn, 10)
        general = await _record(conn, general=True, succeeded=["default"])
        cur = await conn.execute(
            "SELECT failing_since IS NULL FROM webhook_endpoints WHERE id = 'default'"
        )
        assert await cur.fetchone() == (True,)
        await conn.execute(
            "UPDATE webhook_endpoints SET failing_since = now() WHERE id = 'default'"
        )
        plain = await _record(conn, general=False, succeeded=["default"])
        cur = await conn.execute(
            "SELECT failing_since IS NULL FROM webhook_endpoints WHERE id = 'default'"
        )
        assert await cur.fetchone() == (True,), "the plain statement ends the failure streak"
        # The same values row for row (the rows differ only in id and write times).
        by_general = await _written(conn, general)
        by_plain = await _written(conn, plain)
        assert by_plain == by_general
        assert all(row[0] is True and row[2] == "delivered" for row in by_plain)
        assert {row[3] for row in by_plain} == {"default"}
        # Nothing else was written: no retry row, no dead letter.
        cur = await conn.execute("SELECT count(*) FROM webhook_outbox WHERE attempt > 1")
        assert await cur.fetchone() == (0,)


async def test_a_row_completed_meanwhile_is_not_written_again(database_url: str) -> None:
    """Like the general statement, the plain one writes only rows still pending: a row
    recorded by another transaction keeps what that one wrote."""
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


def test_only_the_common_batch_takes_the_plain_statement() -> None:
    delivered = Completion(1, Outcome.DELIVERED, status_code=200, endpoint_id="default")
    routed = Completion(2, Outcome.ROUTED)
    assert is_plain([delivered, routed], prerouted={2})
    # An event row the completion itself must route, or one marked routed that was not.
    assert not is_plain([delivered], route=[3])
    assert not is_plain([delivered, routed])
    # Any other outcome, a lease, or a failure streak to start.
    for other in (Outcome.RETRY, Outcome.DEAD_LETTER, Outcome.DEFERRED, Outcome.PARKED):
        assert not is_plain([delivered, Completion(3, other)])
    leased = Completion(1, Outcome.DELIVERED, lease=uuid.uuid4())
    assert not is_plain([leased])
    assert not is_plain([delivered], failed=["e1"])


async def test_the_claim_keeps_one_plan(database_url: str) -> None:
    """Executed as the dispatcher executes it (prepared by psycopg after a few runs), the
    claim is planned once: PostgreSQL's generic plan, not a custom plan per batch."""
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


async def test_an_endpoint_batch_is_recorded_by_the_plain_statement(database_url: str) -> None:
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
