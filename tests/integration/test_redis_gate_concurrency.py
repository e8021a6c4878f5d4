"""RedisGate under contention: many asyncio tasks on several clients, and several processes.

The invariants checked are the ones that matter for the consumer: never more than
``retry_rps`` retries in any window, and never two probes while a probe holds its lease.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
import redis
from redis.asyncio import Redis

from fluxora_webhooks.gate import Admission
from fluxora_webhooks.metrics import REGISTRY
from fluxora_webhooks.redis_gate import (
    OPEN,
    RedisGate,
    breaker_key,
    rate_limit_key,
    read_breaker_state,
)
from tests.support.gates import server_ms

pytestmark = pytest.mark.integration

URL = "https://consumer.example/hooks"
TASKS, CLIENTS, PROCESSES = 50, 5, 4


@pytest.fixture
async def clients(redis_url: str) -> AsyncIterator[list[Redis]]:
    made = [Redis.from_url(redis_url) for _ in range(CLIENTS)]
    yield made
    for client in made:
        await client.aclose()


def gate_options(prefix: str, **overrides: Any) -> dict[str, Any]:
    # A generous timeout: a fail-open under load would admit without counting.
    options: dict[str, Any] = {
        "retry_rps": 20,
        "breaker_threshold": 0,
        "breaker_reset_ms": 60_000,
        "probe_ttl_ms": 60_000,
        "prefix": prefix,
        "timeout_ms": 10_000,
    }
    options.update(overrides)
    return options


def fail_opens() -> float:
    return sum(
        REGISTRY.get_sample_value("fluxora_webhook_redis_fail_open_total", {"component": c}) or 0.0
        for c in ("gate", "ratelimit", "breaker")
    )


@dataclass
class Tally:
    allowed: int = 0
    rate_limited: int = 0
    circuit_open: int = 0
    probes: list[str] = field(default_factory=list)

    def add(self, admissions: list[Admission]) -> None:
        for admission in admissions:
            if admission.probe:
                self.probes.append(admission.probe_token)
            if admission.allowed:
                self.allowed += 1
            elif admission.reason == "rate_limited":
                self.rate_limited += 1
            else:
                assert admission.reason == "circuit_open", admission
                self.circuit_open += 1

    def merge(self, other: dict[str, Any]) -> None:
        self.allowed += other["allowed"]
        self.rate_limited += other["rate_limited"]
        self.circuit_open += other["circuit_open"]
        self.probes.extend(other["probes"])


async def hammer(gates: list[RedisGate], attempts: list[int], seconds: float) -> Tally:
    """``TASKS`` tasks spread over the gates, each admitting batches until the deadline."""
    tally = Tally()
    deadline = time.monotonic() + seconds

    async def run(gate: RedisGate) -> None:
        while time.monotonic() < deadline:
            tally.add(await gate.admit(URL, attempts))

    async with asyncio.TaskGroup() as group:
        for i in range(TASKS):
            group.create_task(run(gates[i % len(gates)]))
    return tally


class ZsetRecorder:
    """Polls the rate-limit set from a thread and keeps every member it ever saw.

    A member stays in the set for at least one window (pruning removes only members a
    window old), so polling every 20 ms sees every attempt the gate ever recorded.
    """

    def __init__(self, key: str, redis_url: str) -> None:
        self.key = key
        self.redis_url = redis_url
        self.seen: dict[bytes, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        client = redis.Redis.from_url(self.redis_url)
        try:
            while not self._stop.wait(0.02):
                self._poll(client)
            self._poll(client)
        finally:
            client.close()

    def _poll(self, client: redis.Redis) -> None:
        entries = client.zrange(self.key, 0, -1, withscores=True)
        self.seen.update(cast(list[tuple[bytes, float]], entries))

    def __enter__(self) -> ZsetRecorder:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def assert_window_respected(self, limit: int, window_ms: int) -> None:
        scores = sorted(self.seen.values())
        for i in range(len(scores) - limit):
            # limit + 1 consecutive attempts must span at least a whole window.
            assert scores[i + limit] - scores[i] >= window_ms, (i, scores[i : i + limit + 1])


async def test_concurrent_tasks_never_exceed_the_retry_rate(
    clients: list[Redis], prefix: str, redis_url: str
) -> None:
    gates = [RedisGate(c, **gate_options(prefix)) for c in clients]
    failed_open = fail_opens()

    with ZsetRecorder(rate_limit_key(URL, prefix), redis_url) as recorder:
        tally = await hammer(gates, [2, 3], seconds=2.5)

    assert fail_opens() == failed_open
    # Every admitted retry was recorded, and no window holds more than the limit.
    assert len(recorder.seen) == tally.allowed
    recorder.assert_window_respected(limit=20, window_ms=1000)
    # The limit was saturated (so the check above is not vacuous) and still let work through.
    assert tally.allowed >= 20
    assert tally.rate_limited > tally.allowed


CHILD = r"""
import asyncio, json, sys, time
from redis.asyncio import Redis
from fluxora_webhooks.metrics import REGISTRY
from fluxora_webhooks.redis_gate import RedisGate
from tests.support.gates import server_ms

config = json.loads(sys.argv[1])

async def main():
    clients = [Redis.from_url(config["redis_url"]) for _ in range(2)]
    gates = [RedisGate(c, **config["gate"]) for c in clients]
    tally = {"allowed": 0, "rate_limited": 0, "circuit_open": 0, "probes": []}
    print("ready", flush=True)
    while not await clients[0].exists(config["go"]):
        await asyncio.sleep(0.005)
    deadline = time.monotonic() + config["seconds"]

    async def run(gate):
        while time.monotonic() < deadline:
            for a in await gate.admit(config["url"], config["attempts"]):
                if a.probe:
                    tally["probes"].append(a.probe_token)
                if a.allowed:
                    tally["allowed"] += 1
                else:
                    tally[a.reason] += 1

    await asyncio.gather(*(run(gates[i % 2]) for i in range(config["tasks"])))
    for c in clients:
        await c.aclose()
    tally["fail_open"] = sum(
        REGISTRY.get_sample_value("fluxora_webhook_redis_fail_open_total", {"component": c})
        or 0.0
        for c in ("gate", "ratelimit", "breaker")
    )
    print(json.dumps(tally), flush=True)

asyncio.run(main())
"""


@pytest.fixture
def run_processes(prefix: str, redis_url: str) -> Iterator[Any]:
    """Starts ``PROCESSES`` hammering processes, releases them together, returns their tallies."""
    started: list[subprocess.Popen[str]] = []

    def run(gate: dict[str, Any], attempts: list[int], seconds: float) -> Tally:
        config = {
            "redis_url": redis_url,
            "gate": gate,
            "url": URL,
            "attempts": attempts,
            "seconds": seconds,
            "tasks": 10,
            "go": f"{prefix}go",
        }
        for _ in range(PROCESSES):
            started.append(
                subprocess.Popen(
                    [sys.executable, "-c", CHILD, json.dumps(config)],
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        for proc in started:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "ready"
        go = redis.Redis.from_url(redis_url)
        try:
            go.set(f"{prefix}go", "1", px=600_000)
        finally:
            go.close()
        tally = Tally()
        for proc in started:
            out, _ = proc.communicate(timeout=120)
            assert proc.returncode == 0
            result = json.loads(out)
            assert result["fail_open"] == 0
            tally.merge(result)
        return tally

    yield run
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_processes_never_exceed_the_retry_rate(
    prefix: str, run_processes: Any, redis_url: str
) -> None:
    with ZsetRecorder(rate_limit_key(URL, prefix), redis_url) as recorder:
        tally = run_processes(gate_options(prefix), attempts=[2, 2, 5], seconds=2.5)

    assert len(recorder.seen) == tally.allowed
    recorder.assert_window_respected(limit=20, window_ms=1000)
    assert tally.allowed >= 20
    assert tally.rate_limited > tally.allowed


async def open_circuit(client: Redis, prefix: str, reset_ms: int, probe_ttl_ms: int) -> int:
    """Opens URL's circuit (threshold 1); returns its reset time (Redis clock, ms)."""
    gate = RedisGate(
        client,
        **gate_options(
            prefix, breaker_threshold=1, breaker_reset_ms=reset_ms, probe_ttl_ms=probe_ttl_ms
        ),
    )
    [admission] = await gate.admit(URL, [1])
    await gate.report(URL, [(admission, False)])
    state = await read_breaker_state(client, URL, prefix)
    assert state.state == OPEN
    await client.delete(rate_limit_key(URL, prefix))
    return state.reset_at_ms


async def test_concurrent_tasks_take_a_single_probe(
    redis_client: Redis, clients: list[Redis], prefix: str
) -> None:
    await open_circuit(redis_client, prefix, reset_ms=400, probe_ttl_ms=60_000)
    # A window that never prunes: the set keeps the time of every attempt sent.
    options = gate_options(
        prefix,
        breaker_threshold=1,
        breaker_reset_ms=400,
        probe_ttl_ms=60_000,
        window_ms=600_000,
        retry_rps=1_000_000,
    )
    gates = [RedisGate(c, **options) for c in clients]

    # Callers start while the circuit is open and keep going well past its reset.
    tally = await hammer(gates, [1, 2], seconds=1.5)

    assert len(tally.probes) == 1
    assert tally.allowed == 1
    assert tally.circuit_open > 100
    assert await redis_client.zcard(rate_limit_key(URL, prefix)) == 1


async def test_processes_take_a_single_probe(
    redis_client: Redis, prefix: str, run_processes: Any
) -> None:
    await open_circuit(redis_client, prefix, reset_ms=600, probe_ttl_ms=60_000)
    options = gate_options(
        prefix,
        breaker_threshold=1,
        breaker_reset_ms=600,
        probe_ttl_ms=60_000,
        window_ms=600_000,
        retry_rps=1_000_000,
    )

    tally = await asyncio.to_thread(run_processes, options, [1], 2.0)

    assert len(tally.probes) == 1
    assert tally.allowed == 1
    assert await redis_client.zcard(rate_limit_key(URL, prefix)) == 1


async def test_probes_are_one_lease_apart_when_probers_crash(
    redis_client: Redis, clients: list[Redis], prefix: str
) -> None:
    reset_at = await open_circuit(redis_client, prefix, reset_ms=100, probe_ttl_ms=300)
    options = gate_options(
        prefix,
        breaker_threshold=1,
        breaker_reset_ms=100,
        probe_ttl_ms=300,
        window_ms=600_000,
        retry_rps=1_000_000,
    )
    gates = [RedisGate(c, **options) for c in clients]

    # Nobody reports: every probe "crashes", its lease expires, the next caller probes.
    tally = await hammer(gates, [1], seconds=1.6)
    end = await server_ms(redis_client)

    assert len(set(tally.probes)) == len(tally.probes) == tally.allowed
    assert len(tally.probes) >= 2
    entries = await redis_client.zrange(rate_limit_key(URL, prefix), 0, -1, withscores=True)
    granted = sorted(score for _, score in cast(list[tuple[bytes, float]], entries))
    assert len(granted) == len(tally.probes)
    assert granted[0] >= reset_at
    # A new probe only once the previous lease (300 ms) has expired.
    assert all(later - earlier >= 300 for earlier, later in itertools.pairwise(granted))
    assert len(granted) <= (end - reset_at) // 300 + 1


async def test_concurrent_failures_open_once_and_do_not_extend_reset_at(
    redis_client: Redis, clients: list[Redis], prefix: str
) -> None:
    options = gate_options(prefix, breaker_threshold=5, breaker_reset_ms=60_000)
    gates = [RedisGate(c, **options) for c in clients]
    admitted = [await gates[i % CLIENTS].admit(URL, [1]) for i in range(TASKS)]
    label = {"from_state": "closed", "to_state": "open"}
    opened = REGISTRY.get_sample_value("fluxora_webhook_circuit_breaker_transitions_total", label)

    async def report_failure(i: int) -> None:
        await gates[i % CLIENTS].report(URL, [(admitted[i][0], False)])

    await asyncio.gather(*(report_failure(i) for i in range(TASKS)))
    state = await read_breaker_state(redis_client, URL, prefix)
    assert state.state == OPEN
    assert state.failures == 5
    after = REGISTRY.get_sample_value("fluxora_webhook_circuit_breaker_transitions_total", label)
    assert (after or 0.0) - (opened or 0.0) == 1

    await asyncio.gather(*(report_failure(i) for i in range(TASKS)))
    assert await read_breaker_state(redis_client, URL, prefix) == state


async def test_threshold_zero_never_gates_under_load(
    redis_client: Redis, clients: list[Redis], prefix: str
) -> None:
    gates = [RedisGate(c, **gate_options(prefix, breaker_threshold=0)) for c in clients]

    async def fail_and_admit(i: int) -> list[Admission]:
        gate = gates[i % CLIENTS]
        admissions = await gate.admit(URL, [1, 1])
        await gate.report(URL, [(a, False) for a in admissions])
        return await gate.admit(URL, [1])

    results = await asyncio.gather(*(fail_and_admit(i) for i in range(TASKS)))

    assert all(a.allowed and not a.probe for batch in results for a in batch)
    assert await redis_client.exists(breaker_key(URL, prefix)) == 0
