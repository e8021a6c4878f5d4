"""Exactly-once effects end to end: a real ``fluxora-webhooks run`` dispatcher delivers 1,000
events, enqueued by plain SQL, to a consumer (three processes on one port) that keeps a
balance in its own database through the inbox. Meanwhile its processes are SIGKILLed at
random moments by the test, kill themselves after some commits and before answering (so
the sender retries what was already applied) and before some commits, and answer 503 to
some requests.

At the end the balance is exactly the sum of the 1,000 amounts, each delivery id is in the
inbox once, the handler ran once per id, and every id whose answer was lost after its commit
came back and was answered "duplicate". The seed is printed; ``CHAOS_SEED=<n>`` replays the
kill schedule and the amounts."""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.support.dispatch import SECRET
from tests.support.inbox import ConsumerProcess
from tests.support.inbox_consumer import prepare
from tests.support.procs import (
    command_env,
    dispatcher_env,
    free_port,
    run_command,
    start_dispatcher,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

EVENTS = 1000
REPLICAS = 3
EXTERNAL_KILLS = 8
DUPLICATE = '%"status": "duplicate"%'


async def _progress(conn: psycopg.AsyncConnection[Any]) -> tuple[int, int]:
    """(rows pending, events delivered) in the outbox."""
    cur = await conn.execute(
        "SELECT count(*) FILTER (WHERE NOT processed),"
        " count(DISTINCT delivery_id) FILTER (WHERE outcome = 'delivered') FROM webhook_outbox"
    )
    row = await cur.fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


async def _sender_view(conn: psycopg.AsyncConnection[Any]) -> dict[str, Any]:
    """What the dispatcher recorded: attempts, 503s, dead letters, the ids answered
    "duplicate" (the consumer's answer is kept in ``response_body``), every delivery id."""
    cur = await conn.execute(
        "SELECT count(*), count(*) FILTER (WHERE status_code = 503),"
        " count(*) FILTER (WHERE outcome = 'delivered' AND response_body LIKE %s),"
        " (SELECT count(*) FROM webhook_dead_letter) FROM webhook_outbox",
        (DUPLICATE,),
    )
    row = await cur.fetchone()
    assert row is not None
    cur = await conn.execute(
        "SELECT DISTINCT delivery_id::text FROM webhook_outbox"
        " WHERE outcome = 'delivered' AND response_body LIKE %s",
        (DUPLICATE,),
    )
    duplicate_ids = {r[0] for r in await cur.fetchall()}
    cur = await conn.execute("SELECT DISTINCT delivery_id::text FROM webhook_outbox")
    ids = {r[0] for r in await cur.fetchall()}
    attempts, answered_503, duplicates, dead = map(int, row)
    return {
        "attempts": attempts,
        "answered_503": answered_503,
        "duplicates": duplicates,
        "dead_letters": dead,
        "duplicate_ids": duplicate_ids,
        "ids": ids,
    }


async def _consumer_state(url: str) -> tuple[int, list[tuple[str, int]], list[str]]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        balance = await (await conn.execute("SELECT amount FROM balance WHERE id = 1")).fetchone()
        applied = await (await conn.execute("SELECT delivery_id, count FROM applied")).fetchall()
        inbox = await (await conn.execute("SELECT delivery_id FROM webhook_inbox")).fetchall()
    assert balance is not None
    return int(balance[0]), [(r[0], int(r[1])) for r in applied], [r[0] for r in inbox]


async def test_exactly_once_effects_through_sigkills_lost_answers_and_503s(
    database_url: str,
    empty_database_url: str,
    redis_url: str,
    redis_prefix: str,
    tmp_path: Path,
    record_property: Callable[[str, object], None],
) -> None:
    seed = int(os.environ.get("CHAOS_SEED") or random.randrange(2**32))
    rng = random.Random(seed)
    consumer_db = empty_database_url  # the consumer's own database, apart from the outbox
    code, out = await run_command("inbox", "install", env=command_env(DATABASE_URL=consumer_db))
    assert code == 0, out
    await prepare(consumer_db)

    port = free_port()
    consumer_env = command_env(
        CONSUMER_DATABASE_URL=consumer_db,
        WEBHOOK_SECRET=SECRET.decode(),
        CONSUMER_SEED=str(seed),
        CONSUMER_UNAVAILABLE_RATE="0.05",
        CONSUMER_KILL_BEFORE_COMMIT_RATE="0.01",
        CONSUMER_KILL_AFTER_COMMIT_RATE="0.012",
    )
    # Replicas on one port: a killed one's requests fail, the next ones reach another while
    # it restarts (and the same delivery may reach two at once).
    replicas = [
        ConsumerProcess(
            port, {**consumer_env, "CONSUMER_SEED": f"{seed}-{i}"}, tmp_path / f"consumer-{i}.log"
        )
        for i in range(REPLICAS)
    ]
    await asyncio.gather(*(replica.start() for replica in replicas))
    env = dispatcher_env(
        database_url, redis_url, replicas[0].url, redis_prefix,
        WEBHOOK_RETRY_SCHEDULE="100ms", WEBHOOK_RETRY_RPS="100000",
        WEBHOOK_MAX_ATTEMPTS="1000", WEBHOOK_TIMEOUT_MS="5000", WEBHOOK_POLL_INTERVAL_MS="200",
    )  # fmt: skip
    dispatcher = await start_dispatcher(env, tmp_path / "dispatcher.log")

    amounts = [rng.randint(1, 1000) for _ in range(EVENTS)]
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        for first in range(0, EVENTS, 100):  # waves, so that kills land while events flow
            await conn.execute(
                "INSERT INTO webhook_outbox (stream_id, event_type, payload)"
                " SELECT 'account-' || n, 'account.credited', jsonb_build_object('amount', a)"
                " FROM unnest(%s::int[], %s::int[]) AS t(a, n)",
                (amounts[first : first + 100], list(range(first, first + 100))),
            )
            await asyncio.sleep(0.05)

    external_kills = restarts = 0
    starting: dict[int, asyncio.Task[None]] = {}  # restarts run while the others serve

    def restart(i: int) -> None:
        nonlocal restarts
        restarts += 1
        starting[i] = asyncio.create_task(replicas[i].start())

    deadline = time.monotonic() + 120
    next_kill = time.monotonic() + rng.uniform(0.3, 1.0)
    watch = await psycopg.AsyncConnection.connect(database_url, autocommit=True)
    try:
        while (progress := await _progress(watch)) != (0, EVENTS):
            assert time.monotonic() < deadline, (progress, [r.log()[-1000:] for r in replicas])
            assert dispatcher.proc.returncode is None, dispatcher.log()[-2000:]
            for i, task in list(starting.items()):
                if task.done():
                    task.result()  # a replica that failed to start fails the test
                    del starting[i]
            for i, replica in enumerate(replicas):
                if i not in starting and replica.exited():  # it killed itself
                    restart(i)
            serving = [i for i, r in enumerate(replicas) if i not in starting and not r.exited()]
            if time.monotonic() >= next_kill and external_kills < EXTERNAL_KILLS and serving:
                victim = rng.choice(serving)
                await replicas[victim].kill()
                external_kills += 1
                restart(victim)
                next_kill = time.monotonic() + rng.uniform(0.3, 1.0)
            await asyncio.sleep(0.1)
        sender = await _sender_view(watch)
    finally:
        await watch.close()
        dispatcher.terminate()
        await dispatcher.wait(30)
        for task in starting.values():
            await asyncio.gather(task, return_exceptions=True)
        for replica in replicas:
            await replica.stop()

    balance, applied, inbox = await _consumer_state(consumer_db)
    before = [i for r in replicas for i in r.self_kills("before-commit")]
    after = [i for r in replicas for i in r.self_kills("after-commit")]
    report = {
        "seed": seed,
        "events": EVENTS,
        "attempts": sender["attempts"],
        "answered 503": sender["answered_503"],
        "external SIGKILLs": external_kills,
        "self SIGKILLs before commit": len(before),
        "self SIGKILLs after commit": len(after),
        "restarts": restarts,
        "duplicates absorbed (200 duplicate)": sender["duplicates"],
    }
    record_property("inbox_chaos", report)
    print("\n".join(f"{k:>38}: {v}" for k, v in report.items()))

    assert sender["dead_letters"] == 0
    assert balance == sum(amounts)
    assert sorted(inbox) == sorted(sender["ids"]) and len(inbox) == EVENTS
    assert len(applied) == EVENTS and {count for _, count in applied} == {1}
    # The faults really happened, and each lost answer came back as a repeat.
    assert sender["answered_503"] > 0 and before and after and external_kills > 0
    assert set(after) <= sender["duplicate_ids"]
    assert sender["duplicates"] >= len(set(after))
