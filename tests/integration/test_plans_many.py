"""Query plans with a million processed rows over 1,000 endpoints (tests/support/bigoutbox):
the claim, the fan-out, the ordered streams' next head and their sweep, recovery and the
dead-letter lists use their indexes and read a bounded number of rows, never the backlog.

Each statement runs under EXPLAIN (ANALYZE, BUFFERS) in a transaction that is rolled back,
so every test sees the same data; the rows a plan examined (returned plus removed by a
filter, times its loops) are what is bounded, not a time.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from fluxora_webhooks.delivery import HELD_WORDS
from fluxora_webhooks.outbox import Completion, Outcome, complete_statement
from fluxora_webhooks.queries import query, variant
from tests.support import bigoutbox, engines

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BIG = ("webhook_outbox", "webhook_dead_letter")


@pytest.fixture(scope="module")
def big_url(pg_admin_url: str, template_db: str) -> Iterator[str]:
    with engines.copied_database(pg_admin_url, template_db, "fluxora_plans_") as url:

        async def fill() -> None:
            async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
                await bigoutbox.build(conn)

        asyncio.run(fill())
        yield url


def nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from nodes(child)


class Plan:
    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.all = list(nodes(root))

    def scans(self) -> list[dict[str, Any]]:
        return [n for n in self.all if n.get("Relation Name") in BIG]

    def indexes(self) -> set[str]:
        return {str(n["Index Name"]) for n in self.all if "Index Name" in n}

    def seq_scans(self) -> list[str]:
        return [
            str(n.get("Relation Name"))
            for n in self.all
            if n["Node Type"] in ("Seq Scan", "Parallel Seq Scan") and n.get("Relation Name") in BIG
        ]

    def examined(self) -> int:
        """Rows the scans of the big tables looked at: returned or filtered out, per loop."""
        total = 0.0
        for n in self.scans():
            per_loop = (
                n.get("Actual Rows", 0)
                + n.get("Rows Removed by Filter", 0)
                + n.get("Rows Removed by Index Recheck", 0)
            )
            total += per_loop * n.get("Actual Loops", 1)
        return int(total)

    def check(self, *, uses: set[str], max_examined: int) -> None:
        shown = json.dumps(self.root, indent=1, default=str)[:6000]
        assert not self.seq_scans(), f"scans {self.seq_scans()} whole:\n{shown}"
        assert uses <= self.indexes(), f"uses {self.indexes()}, not {uses}:\n{shown}"
        assert self.examined() <= max_examined, f"examined {self.examined()} rows:\n{shown}"


async def explain(
    conn: psycopg.AsyncConnection[Any], statement: str, params: Any = None, *, native: bool = False
) -> Plan:
    """The plan of ``statement``, run and rolled back; ``native``: it has ``$n`` placeholders
    (sent as it is, as :func:`fluxora_webhooks.outbox.complete` sends its statement)."""
    async with conn.transaction(force_rollback=True):
        cur: Any = psycopg.AsyncRawCursor(conn) if native else conn.cursor()
        await cur.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + statement, params)
        row = await cur.fetchone()
    assert row is not None
    doc = row[0] if isinstance(row[0], list) else json.loads(row[0])
    return Plan(doc[0]["Plan"])


async def explain_update_within(
    conn: psycopg.AsyncConnection[Any], statement: str, params: Any = None
) -> Plan:
    """The plan of the UPDATE that ``statement`` runs inside a function (run and rolled
    back), as auto_explain reports the statements nested in it."""
    reported: list[str] = []

    def report(notice: psycopg.errors.Diagnostic) -> None:
        reported.append(notice.message_primary or "")

    conn.add_notice_handler(report)
    try:
        await _run_explained(conn, statement, params)
    finally:
        conn.remove_notice_handler(report)
    plans = [
        json.loads(text[text.index("{") :])["Plan"]
        for text in reported
        if text.startswith("duration:") and "{" in text
    ]
    updates = [p for p in plans if p.get("Operation") == "Update"]
    assert len(updates) == 1, f"one UPDATE within, not {len(updates)}: {reported}"
    return Plan(updates[0])


async def _run_explained(
    conn: psycopg.AsyncConnection[Any], statement: str, params: Any = None
) -> None:
    """Run ``statement`` and roll it back, auto_explain reporting its nested statements."""
    async with conn.transaction(force_rollback=True):
        await conn.execute("LOAD 'auto_explain'")
        for setting, value in (
            ("auto_explain.log_min_duration", "0"),
            ("auto_explain.log_analyze", "on"),
            ("auto_explain.log_buffers", "on"),
            ("auto_explain.log_format", "json"),
            ("auto_explain.log_nested_statements", "on"),
            ("client_min_messages", "log"),
        ):
            await conn.execute("SELECT set_config(%s, %s, true)", (setting, value))
        cur = await conn.execute(statement, params)
        await cur.fetchall()


async def connect(url: str) -> psycopg.AsyncConnection[Any]:
    return await psycopg.AsyncConnection.connect(url, autocommit=True)


async def test_the_claim_reads_a_batch(big_url: str) -> None:
    async with await connect(big_url) as conn:
        plan = await explain(conn, query("claim_due"), {"batch": 10})
    plan.check(uses={"webhook_outbox_due_idx"}, max_examined=100)


async def test_routing_a_batch_of_events_reads_their_tenants_endpoints(big_url: str) -> None:
    async with await connect(big_url) as conn:
        cur = await conn.execute(
            "SELECT id, partition_at FROM webhook_outbox"
            " WHERE NOT processed AND endpoint_id IS NULL ORDER BY id LIMIT 10"
        )
        events = {int(r[0]): r[1] for r in await cur.fetchall()}
        assert len(events) == 10
        statement, params = complete_statement(
            [Completion(i, Outcome.ROUTED) for i in events], events, route=list(events)
        )
        plan = await explain(conn, statement, params, native=True)
    # Ten events of ten tenants, ten endpoints each: a hundred deliveries written, the
    # event rows found by key, the endpoints by tenant.
    plan.check(uses={"webhook_outbox_pkey"}, max_examined=500)
    inserts = [n for n in plan.all if n.get("Operation") == "Insert"]
    assert inserts, "no insert of deliveries in the plan"


async def test_the_next_head_of_a_deep_stream_is_one_index_probe(big_url: str) -> None:
    params = {"endpoints": [bigoutbox.DEEP_ENDPOINT], "streams": [bigoutbox.DEEP_STREAM]}
    async with await connect(big_url) as conn:
        plan = await explain_update_within(conn, query("promote_heads"), params)
        async with conn.transaction(force_rollback=True):
            cur = await conn.execute(query("promote_heads"), params)
            promoted = [int(r[0]) for r in await cur.fetchall()]
            cur = await conn.execute(
                "SELECT min(id) FROM webhook_outbox WHERE endpoint_id = %s AND stream_id = %s"
                " AND NOT processed",
                (bigoutbox.DEEP_ENDPOINT, bigoutbox.DEEP_STREAM),
            )
            row = await cur.fetchone()
    assert row is not None
    assert promoted == [row[0]], "the stream's lowest waiting delivery is its next head"
    # 100,000 deliveries wait in that stream; choosing the head reads a handful.
    plan.check(
        uses={"webhook_outbox_stream_idx", "webhook_outbox_stream_active_idx"}, max_examined=50
    )


async def test_heads_of_streams_with_an_active_delivery_are_left_alone(big_url: str) -> None:
    pairs = [
        (bigoutbox.endpoint_id(e), f"o-{s}")
        for e in range(0, bigoutbox.ENDPOINTS, 10)
        for s in range(bigoutbox.ORDERED_STREAMS)
    ]
    params = {"endpoints": [e for e, _ in pairs], "streams": [s for _, s in pairs]}
    async with await connect(big_url) as conn:
        plan = await explain_update_within(conn, query("promote_heads"), params)
        async with conn.transaction(force_rollback=True):
            cur = await conn.execute(query("promote_heads"), params)
            assert await cur.fetchall() == [], "every one of these streams has its head in flight"
    plan.check(uses={"webhook_outbox_stream_active_idx"}, max_examined=20 * len(pairs))


async def test_a_routing_batch_finds_due_heads_by_their_own_index(big_url: str) -> None:
    """The heads a routing batch sends in its spare room (route_events): a batch of the
    1,000 heads in flight, read from the index that holds only them, not the backlog."""
    params = {
        "ids": [],
        "part_lo": datetime(1970, 1, 1, tzinfo=UTC),
        "part_hi": datetime(1970, 1, 1, tzinfo=UTC),
        "cap": 10,
        "heads": 10,
        "claimed": [],
        "since": datetime(1, 1, 1, tzinfo=UTC),
    }
    async with await connect(big_url) as conn:
        plan = await explain(conn, query("route_events"), params)
        async with conn.transaction(force_rollback=True):
            cur = await conn.execute(query("route_events"), params)
            found = [r for r in await cur.fetchall() if r[0] is not None]
    assert len(found) == 10 and all(r[11] is not None for r in found), "ten ordered heads"
    plan.check(uses={"webhook_outbox_heads_due_idx"}, max_examined=50)


async def test_routing_to_idle_ordered_streams_is_two_probes_a_delivery(big_url: str) -> None:
    """Two events of a tenant whose ten endpoints are all ordered, with every stream's lock
    held: one of the deep stream (100,000 deliveries waiting at one endpoint) and one of a
    new stream. Whether each of the twenty deliveries can be due at once is a probe of the
    stream's pending deliveries and one of its events still to be routed, however deep."""
    tenant = bigoutbox.tenant_of(0)
    async with await connect(big_url) as conn:
        cur = await conn.execute(
            "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload)"
            " SELECT %s, s, 'stream.updated', '{}' FROM unnest(ARRAY[%s, 'fresh']) AS s"
            " RETURNING id, partition_at",
            (tenant, bigoutbox.DEEP_STREAM),
        )
        events = {int(r[0]): r[1] for r in await cur.fetchall()}
        try:
            cur = await conn.execute(
                "SELECT id FROM webhook_endpoints WHERE tenant = %s AND ordered", (tenant,)
            )
            ordered = [str(r[0]) for r in await cur.fetchall()]
            assert len(ordered) == 10
            pairs = [(e, s) for e in ordered for s in (bigoutbox.DEEP_STREAM, "fresh")]
            params = {
                "ids": list(events),
                "part_lo": min(events.values()),
                "part_hi": max(events.values()),
                "cap": 30,
                "heads": 0,
                "claimed": [],
                "since": datetime(1, 1, 1, tzinfo=UTC),
                "locked_endpoints": [e for e, _ in pairs],
                "locked_streams": [s for _, s in pairs],
            }
            statement = variant("route_events", ("fan_out_head", "fan_out_head_idle"))
            plan = await explain(conn, statement, params)
            async with conn.transaction(force_rollback=True):
                cur = await conn.execute(statement, params)
                due = sorted((r[9], r[8]) for r in await cur.fetchall() if r[0] is not None)
        finally:
            await conn.execute("DELETE FROM webhook_outbox WHERE id = ANY(%s)", (list(events),))
    # Due at once: every endpoint's delivery of the new stream, and the deep stream's at
    # the nine endpoints where nothing of it is pending.
    expected = sorted(
        [(e, "fresh") for e in ordered]
        + [(e, bigoutbox.DEEP_STREAM) for e in ordered if e != bigoutbox.DEEP_ENDPOINT]
    )
    assert due == expected
    plan.check(uses={"webhook_outbox_stream_idx", "webhook_outbox_unrouted_idx"}, max_examined=300)


async def test_the_sweep_walks_streams_not_their_backlog(big_url: str) -> None:
    streams = bigoutbox.ENDPOINTS // 10 * bigoutbox.ORDERED_STREAMS + 1
    async with await connect(big_url) as conn:
        first_page = {"after_endpoint": "", "after_stream": "", "page": 1000}
        plan = await explain(conn, query("stuck_streams"), first_page)
        cur = await conn.execute(query("stuck_streams"), first_page)
        stuck = [(str(r[0]), str(r[1])) for r in await cur.fetchall()]
    assert stuck == [(bigoutbox.DEEP_ENDPOINT, bigoutbox.DEEP_STREAM)]
    plan.check(uses={"webhook_outbox_stream_idx"}, max_examined=5 * streams)


async def test_recovery_reads_one_endpoints_window(big_url: str) -> None:
    now = datetime.now(UTC)
    params = {
        "endpoint_id": bigoutbox.endpoint_id(7),
        "since": now - timedelta(days=2),
        "until": now - timedelta(days=1),
        "batch": 500,
        "start": 0,
        "rps": 10,
    }
    async with await connect(big_url) as conn:
        plan = await explain(conn, query("recover_dead_letters"), params)
    # One endpoint's dead letters of one day out of twenty: about five.
    plan.check(uses={"webhook_dead_letter_endpoint_idx"}, max_examined=100)


@pytest.mark.parametrize(
    ("endpoint", "tenant", "index"),
    [
        (bigoutbox.endpoint_id(5), None, "webhook_dead_letter_endpoint_idx"),
        (None, bigoutbox.tenant_of(5), "webhook_dead_letter_tenant_idx"),
        (None, "t-with-no-dead-letters", "webhook_dead_letter_tenant_idx"),
        (None, None, "webhook_dead_letter_dead_idx"),
    ],
)
async def test_dead_letter_lists_read_one_page(
    big_url: str, endpoint: str | None, tenant: str | None, index: str
) -> None:
    params = {"all": False, "endpoint_id": endpoint, "tenant": tenant, "limit": 50}
    async with await connect(big_url) as conn:
        plan = await explain(conn, query("dlq_list"), params)
    plan.check(uses={index}, max_examined=60)


async def test_the_api_lists_read_one_page_unfiltered(big_url: str) -> None:
    scope = {"scoped": False, "tenant": None, "f_tenant": None, "stream_id": None}
    deliveries = {
        **scope,
        "endpoint_id": None,
        "status": None,
        "event_type": None,
        "event": None,
        "before": None,
        "held": False,
        "held_words": HELD_WORDS,
        "limit": 51,
    }
    async with await connect(big_url) as conn:
        plan = await explain(conn, query("delivery_list"), deliveries)
        plan.check(uses={"webhook_outbox_delivery_idx"}, max_examined=1000)
        one = await explain(conn, query("delivery_list"), {**deliveries, "event": 12345})
        one.check(uses={"webhook_outbox_event_idx"}, max_examined=100)


# A tenant's events and an endpoint's deliveries have indexes of their own (migration
# 0008): a small tenant or endpoint among many reads one page, not the outbox.
@pytest.mark.parametrize("scoped", [True, False])
async def test_the_api_event_list_of_one_tenant_reads_one_page(big_url: str, scoped: bool) -> None:
    tenant = bigoutbox.tenant_of(5)
    params = {
        "scoped": scoped,  # a tenant's token, or an admin's filter by tenant
        "tenant": tenant if scoped else None,
        "f_tenant": None if scoped else tenant,
        "stream_id": None,
        "event_type": None,
        "before": None,
        "limit": 51,
    }
    async with await connect(big_url) as conn:
        plan = await explain(conn, query("event_list"), params)
    plan.check(uses={"webhook_outbox_tenant_events_idx"}, max_examined=100)


async def test_the_api_delivery_list_of_one_endpoint_reads_one_page(big_url: str) -> None:
    params = {
        "scoped": False,
        "tenant": None,
        "f_tenant": None,
        "endpoint_id": bigoutbox.endpoint_id(5),
        "status": None,
        "stream_id": None,
        "event_type": None,
        "event": None,
        "before": None,
        "held": False,
        "held_words": HELD_WORDS,
        "limit": 51,
    }
    async with await connect(big_url) as conn:
        plan = await explain(conn, query("delivery_list"), params)
    plan.check(uses={"webhook_outbox_endpoint_deliveries_idx"}, max_examined=1000)
