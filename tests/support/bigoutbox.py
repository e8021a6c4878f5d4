"""A large outbox for query-plan tests, built in seconds with generate_series.

1,000 endpoints over 100 tenants (every tenth one ordered), a million processed delivery
rows over them, a pending backlog of every kind (due deliveries, event rows still to be
routed, ordered heads and the deliveries waiting behind them, parked rows), one ordered
stream 100,000 deliveries deep whose head was just delivered, and 100,000 dead letters.
Names below are what the tests ask about.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

ENDPOINTS = 1000
TENANTS = 100
PROCESSED = 1_000_000
DUE = 5000
UNROUTED = 2000
ORDERED_STREAMS = 10  # per ordered endpoint, each with a head and WAITING_PER_STREAM behind
WAITING_PER_STREAM = 5
DEEP_ENDPOINT = "ep-0000"  # ordered (every tenth endpoint is)
DEEP_STREAM = "deep"
DEEP_WAITING = 100_000
DEAD_LETTERS = 100_000
PARKED_ENDPOINT = "ep-0001"
PARKED = 20_000


def endpoint_id(n: int) -> str:
    return f"ep-{n:04d}"


def tenant_of(n: int) -> str:
    return f"t-{n % TENANTS:03d}"


# The endpoint of row g, and its tenant, as SQL over an integer g.
_EP = "'ep-' || lpad(({g} % 1000)::text, 4, '0')"
_TENANT = "'t-' || lpad((({g} % 1000) % 100)::text, 3, '0')"
_UUID = "('00000000-0000-4000-8000-' || lpad(to_hex({g}), 12, '0'))::uuid"


def _ep(g: str = "g") -> str:
    return _EP.format(g=g)


def _tenant(g: str = "g") -> str:
    return _TENANT.format(g=g)


def _uuid(g: str = "g") -> str:
    return _UUID.format(g=g)


async def build(conn: psycopg.AsyncConnection[Any]) -> None:
    """Fill a freshly migrated database (autocommit connection) and ANALYZE it."""
    await conn.execute("SET synchronous_commit = off")
    await conn.execute("SET maintenance_work_mem = '256MB'")
    # Loaded without the secondary indexes, which are then built from their own definitions
    # (one sort each, much faster than a million insertions each).
    cur = await conn.execute(
        "SELECT indexname, indexdef FROM pg_indexes"
        " WHERE tablename IN ('webhook_outbox', 'webhook_dead_letter')"
        " AND indexname NOT LIKE '%_pkey' ORDER BY indexname"
    )
    indexes = [(str(r[0]), str(r[1])) for r in await cur.fetchall()]
    for name, _ in indexes:
        await conn.execute(sql.SQL("DROP INDEX {}").format(sql.Identifier(name)))
    await conn.execute(
        "INSERT INTO webhook_endpoints (id, tenant, url, secret, ordered, event_types,"
        " created_at)"
        f" SELECT {_ep()}, {_tenant()}, 'https://consumer-' || g || '.example/hook',"
        " 'whsec_MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=', g % 10 = 0,"
        " CASE WHEN g % 3 = 0 THEN '{stream.*}'::text[] ELSE '{*}'::text[] END,"
        " timestamptz '2024-01-01'"
        f" FROM generate_series(0, {ENDPOINTS - 1}) g"
    )
    await conn.execute(
        "INSERT INTO webhook_endpoints (id, tenant, url, created_at)"
        " VALUES ('default', '', 'http://127.0.0.1:9/hook', timestamptz '2024-01-01')"
    )
    # The history: a million delivered attempts, old, spread over every endpoint.
    await conn.execute(
        "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload, created_at,"
        " enqueued_at, partition_at, processed, processed_at, outcome, status_code,"
        " duration_ms, delivery_id, endpoint_id, event_id, stream_seq)"
        f" SELECT {_tenant()}, 's-' || (g % 5000), 'stream.updated', '{{\"n\": 1}}'::jsonb,"
        " ts, ts, ts, true, ts, 'delivered', 200, 1.5,"
        f" {_uuid()}, {_ep()}, g, CASE WHEN g % 10 = 0 THEN g END"
        f" FROM generate_series(1, {PROCESSED}) g,"
        " LATERAL (SELECT timestamptz '2024-06-01' + g * interval '10 ms') t(ts)"
    )
    base = PROCESSED + 1
    # Due deliveries of unordered endpoints (ids above the history's).
    await conn.execute(
        "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload, created_at,"
        " delivery_id, endpoint_id, event_id)"
        f" SELECT {_tenant('(g * 10 + 1)')}, 'due-' || g, 'stream.updated', '{{}}'::jsonb,"
        f" now() - interval '1 minute', {_uuid(f'({base} + g)')}, {_ep('(g * 10 + 1)')},"
        f" {base} + g"
        f" FROM generate_series(0, {DUE - 1}) g"
    )
    base += DUE
    # Event rows still to be routed (the producer's INSERT).
    await conn.execute(
        "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload, created_at,"
        " delivery_id)"
        f" SELECT {_tenant()}, 'ev-' || g, 'stream.created', '{{}}'::jsonb,"
        f" now() - interval '30 seconds', {_uuid(f'({base} + g)')}"
        f" FROM generate_series(0, {UNROUTED - 1}) g"
    )
    base += UNROUTED
    # Ordered streams: on each ordered endpoint, heads in flight (due, hold NULL) and the
    # deliveries waiting behind them.
    per_stream = WAITING_PER_STREAM + 1
    rows = ENDPOINTS // 10 * ORDERED_STREAMS * per_stream
    await conn.execute(
        "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload, created_at,"
        " delivery_id, endpoint_id, event_id, stream_seq, hold)"
        f" SELECT {_tenant('ep')}, 'o-' || st, 'stream.updated', '{{}}'::jsonb,"
        " CASE WHEN k = 0 THEN now() - interval '1 minute' ELSE 'infinity' END,"
        f" {_uuid(f'({base} + g)')}, {_ep('ep')}, {base} + g, {base} + g,"
        " CASE WHEN k = 0 THEN NULL ELSE 'waiting' END"
        f" FROM generate_series(0, {rows - 1}) g,"
        f" LATERAL (SELECT (g / {per_stream * ORDERED_STREAMS}) * 10 AS ep,"
        f" (g / {per_stream}) % {ORDERED_STREAMS} AS st, g % {per_stream} AS k) x"
    )
    base += rows
    # One deep stream: its head was just delivered, every later delivery is waiting.
    await conn.execute(
        "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload, created_at,"
        " delivery_id, endpoint_id, event_id, stream_seq, hold)"
        f" SELECT %(tenant)s, %(stream)s, 'stream.updated', '{{}}'::jsonb, 'infinity',"
        f" {_uuid(f'({base} + g)')}, %(ep)s, {base} + g, {base} + g, 'waiting'"
        f" FROM generate_series(0, {DEEP_WAITING - 1}) g",
        {"tenant": tenant_of(0), "stream": DEEP_STREAM, "ep": DEEP_ENDPOINT},
    )
    base += DEEP_WAITING
    # A disabled endpoint's parked deliveries.
    await conn.execute(
        "UPDATE webhook_endpoints SET state = 'disabled', disabled_reason = 'failing',"
        " disabled_at = now() WHERE id = %(ep)s",
        {"ep": PARKED_ENDPOINT},
    )
    await conn.execute(
        "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload, created_at,"
        " delivery_id, endpoint_id, event_id, hold)"
        " SELECT %(tenant)s, 'p-' || g, 'stream.updated', '{}'::jsonb, 'infinity',"
        f" {_uuid(f'({base} + g)')}, %(ep)s, {base} + g, 'parked'"
        f" FROM generate_series(0, {PARKED - 1}) g",
        {"tenant": tenant_of(1), "ep": PARKED_ENDPOINT},
    )
    # Dead letters over every endpoint and the last 20 days.
    await conn.execute(
        "INSERT INTO webhook_dead_letter (delivery_id, stream_id, event_type, payload,"
        " attempts, reason, last_status, enqueued_at, dead_at, tenant, endpoint_id, event_id)"
        f" SELECT {_uuid('g')}, 's-' || (g % 5000), 'stream.updated', '{{}}'::jsonb, 8,"
        f" 'max_attempts', 503, ts, ts, {_tenant()}, {_ep()}, g"
        f" FROM generate_series(1, {DEAD_LETTERS}) g,"
        f" LATERAL (SELECT now() - (g * interval '20 days' / {DEAD_LETTERS})) t(ts)"
    )
    for _, definition in indexes:
        await conn.execute(definition.encode())
    await conn.execute("ANALYZE webhook_outbox")
    await conn.execute("ANALYZE webhook_dead_letter")
    await conn.execute("ANALYZE webhook_endpoints")


async def index_names(conn: psycopg.AsyncConnection[Any]) -> set[str]:
    cur = await conn.execute(
        "SELECT indexname FROM pg_indexes"
        " WHERE tablename IN ('webhook_outbox', 'webhook_dead_letter', 'webhook_endpoints')"
    )
    return {str(r[0]) for r in await cur.fetchall()}
