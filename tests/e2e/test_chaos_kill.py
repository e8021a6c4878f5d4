"""kill -9 of random dispatcher processes, every few hundred milliseconds, while thousands of
events flow: every event is delivered, and the duplicates stay within what the killed
processes can have had in flight (batch size x claim loops per kill).

The kill schedule comes from a seed, printed with the report; ``CHAOS_SEED=<n>`` replays it.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.chaos import (
    ChaosConsumer,
    account,
    enqueue_events,
    format_table,
    stop_processes,
    tracebacks,
    wait_ready,
)
from tests.support.dispatch import pending, wait_until
from tests.support.procs import DispatcherProcess, dispatcher_env, start_dispatcher

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


async def test_sigkill_of_random_dispatchers_while_events_flow(
    database_url: str,
    redis_url: str,
    redis_prefix: str,
    tmp_path: Path,
    record_property: Callable[[str, object], None],
) -> None:
    seed = int(os.environ.get("CHAOS_SEED") or random.randrange(2**32))
    rng = random.Random(seed)
    events, wave, batch, loops = 3000, 50, 10, 2
    min_kills, max_kills = 20, 40
    consumer = ChaosConsumer(ok_delay_s=0.01)  # a little latency: batches are in flight
    await consumer.start()
    env = dispatcher_env(
        database_url, redis_url, consumer.url, redis_prefix,
        WEBHOOK_BATCH_SIZE=str(batch), WEBHOOK_CLAIM_LOOPS=str(loops),
        WEBHOOK_POLL_INTERVAL_MS="200",
    )  # fmt: skip
    started = 0

    async def launch() -> DispatcherProcess:
        nonlocal started
        started += 1
        return await start_dispatcher(env, tmp_path / f"dispatcher-{started}.log")

    async def produce() -> None:
        for first in range(1, events + 1, wave):
            await enqueue_events(database_url, ["ok"] * wave, first_n=first)
            await asyncio.sleep(0.1)

    procs = [await launch() for _ in range(3)]
    kills = 0
    try:
        producer = asyncio.create_task(produce())
        while kills < max_kills and not (producer.done() and kills >= min_kills):
            await asyncio.sleep(rng.uniform(0.15, 0.45))
            victim = procs.pop(rng.randrange(len(procs)))
            victim.kill()
            assert await victim.wait(10) == -9
            kills += 1
            procs.append(await launch())
        await producer
        await wait_until(lambda: _drained(database_url), timeout=120, what="all delivered")
        assert all(p.proc.returncode is None for p in procs)
        for p in procs:  # the last replacements may still be starting up
            await wait_ready(p)
    finally:
        codes = await stop_processes(procs)
        await consumer.stop()
    assert codes == [0, 0, 0], [p.log() for p in procs]
    assert all(tracebacks(p.log()) == 0 for p in procs), [p.log() for p in procs]

    accounting = await account(database_url, consumer)
    bound = kills * batch * loops
    report = (
        f"seed={seed}: {kills} kills, {started} processes started, "
        f"{accounting.duplicates} duplicate deliveries (bound {bound})\n{format_table(accounting)}"
    )
    print("\n" + report)
    record_property("sigkill_report", report)
    assert accounting.written == events, report
    assert accounting.ok and accounting.lost == 0, report
    assert accounting.delivered == events, report
    assert accounting.dead_letters == 0, report
    assert accounting.duplicates <= bound, report


async def _drained(database_url: str) -> bool:
    return await pending(database_url) == 0
