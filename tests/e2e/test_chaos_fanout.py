"""Fan-out under kill -9 (SPEC 10): three dispatchers route and deliver events to the
default endpoint and to registered endpoints of two tenants while a random one is killed
every few hundred milliseconds. At the end every (event, endpoint) pair that matches has
exactly one delivery id, every one of them was answered 2xx, no pair that does not match
(and nothing across tenants) was ever created, and nothing is pending."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import random
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest

from fluxora_webhooks import endpoints
from tests.support.chaos import (
    ChaosConsumer,
    account,
    format_table,
    stop_processes,
    tracebacks,
    wait_ready,
)
from tests.support.dispatch import pending, rows, wait_until
from tests.support.procs import DispatcherProcess, dispatcher_env, start_dispatcher

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# (tenant, event types) of the registered endpoints.
SUBSCRIPTIONS = [
    ("", ["*"]),
    ("", ["stream.*"]),
    ("", ["invoice.paid", "stream.created"]),
    ("acme", ["*"]),
    ("acme", ["invoice.*"]),
    ("bolt", ["nothing.ever"]),
]
TYPES = ["stream.created", "stream.updated", "invoice.paid", "invoice.void"]
TENANTS = ["", "acme", "bolt"]


async def test_sigkill_during_fan_out_loses_nothing_and_never_doubles_a_pair(
    database_url: str,
    redis_url: str,
    redis_prefix: str,
    tmp_path: Path,
    record_property: Callable[[str, object], None],
) -> None:
    seed = int(os.environ.get("CHAOS_SEED") or random.randrange(2**32))
    rng = random.Random(seed)
    events, wave = 1800, 30
    consumer = ChaosConsumer(ok_delay_s=0.005)
    await consumer.start()
    subscribed: dict[str, tuple[str, list[str]]] = {}
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        for i, (tenant, types) in enumerate(SUBSCRIPTIONS):
            endpoint, _ = await endpoints.create(
                conn,
                url=f"{consumer.url}&endpoint={i}",
                tenant=tenant,
                event_types=types,
                allowed_networks=endpoints_allowed(),
            )
            subscribed[endpoint.id] = (tenant, types)
    env = dispatcher_env(
        database_url, redis_url, consumer.url, redis_prefix,
        WEBHOOK_BATCH_SIZE="10", WEBHOOK_CLAIM_LOOPS="2", WEBHOOK_POLL_INTERVAL_MS="200",
        WEBHOOK_ALLOWED_NETWORKS="127.0.0.0/8",
    )  # fmt: skip
    started = 0

    async def launch() -> DispatcherProcess:
        nonlocal started
        started += 1
        return await start_dispatcher(env, tmp_path / f"dispatcher-{started}.log")

    async def produce() -> None:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            for first in range(0, events, wave):
                await conn.execute(
                    "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload)"
                    " SELECT (%s::text[])[1 + n %% 3], 's-' || n, (%s::text[])[1 + n %% 4],"
                    "        jsonb_build_object('n', n)"
                    " FROM generate_series(%s::int, %s::int) n",
                    (TENANTS, TYPES, first, first + wave - 1),
                )
                await asyncio.sleep(0.08)

    procs = [await launch() for _ in range(3)]
    kills = 0
    try:
        producer = asyncio.create_task(produce())
        while not producer.done() or kills < 12:
            await asyncio.sleep(rng.uniform(0.2, 0.5))
            victim = procs.pop(rng.randrange(len(procs)))
            victim.kill()
            assert await victim.wait(10) == -9
            kills += 1
            procs.append(await launch())
        await producer
        await wait_until(lambda: _drained(database_url), timeout=120, what="all delivered")
        for p in procs:
            await wait_ready(p)
    finally:
        codes = await stop_processes(procs)
        await consumer.stop()
    assert codes == [0, 0, 0], [p.log() for p in procs]
    assert all(tracebacks(p.log()) == 0 for p in procs), [p.log() for p in procs]

    expected = set()
    for n in range(events):
        tenant, kind = TENANTS[n % 3], TYPES[n % 4]
        for endpoint_id, (t, types) in subscribed.items():
            if t == tenant and endpoints.matches(types, kind):
                expected.add((n, endpoint_id))
        if tenant == "":
            expected.add((n, "default"))
    pairs = await rows(
        database_url,
        "SELECT (payload->>'n')::int, endpoint_id, count(DISTINCT delivery_id)"
        " FROM webhook_outbox WHERE endpoint_id IS NOT NULL GROUP BY 1, 2",
    )
    assert {(n, e) for n, e, _ in pairs} == expected
    assert all(count == 1 for _, _, count in pairs), [p for p in pairs if p[2] != 1][:5]
    accounting = await account(database_url, consumer)
    report = f"seed={seed}: {kills} kills, {len(expected)} deliveries\n{format_table(accounting)}"
    print("\n" + report)
    record_property("fanout_report", report)
    assert accounting.written == len(expected), report
    assert accounting.ok and accounting.lost == 0 and accounting.delivered == len(expected), report
    assert accounting.dead_letters == 0, report


def endpoints_allowed() -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    return (ipaddress.ip_network("127.0.0.0/8"),)


async def _drained(database_url: str) -> bool:
    return await pending(database_url) == 0
