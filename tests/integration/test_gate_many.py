"""A batch's rows for many consumer URLs are admitted in one script call on a single Redis
node (``admit_many``), with exactly the decisions and keys of one ``admit`` per URL:
each URL's own retry limit (an endpoint's ``rate_limit`` included), its own breaker and
probe; a Redis that is down fails the whole batch open."""

from __future__ import annotations

import secrets
from typing import Any

import pytest
from redis.asyncio import Redis

from fluxora_webhooks.gate import ALLOW, Admission, AdmitRequest
from fluxora_webhooks.metrics import REGISTRY
from fluxora_webhooks.redis_gate import RedisGate, breaker_key, rate_limit_key
from tests.support import gates

pytestmark = pytest.mark.integration


def make_gate(client: Redis, prefix: str, **overrides: Any) -> RedisGate:
    return gates.make_gate(
        client,
        prefix,
        **{
            "retry_rps": 2,
            "breaker_threshold": 2,
            "breaker_reset_ms": 60_000,
            "probe_ttl_ms": 10_000,
            **overrides,
        },
    )


def _shape(admissions: list[Admission]) -> list[tuple[bool, str, bool]]:
    return [(a.allowed, a.reason, a.probe) for a in admissions]


async def test_one_call_decides_as_one_admit_per_url(redis_client: Redis, prefix: str) -> None:
    urls = [f"https://consumer-{i}.example/hooks/{secrets.token_hex(4)}" for i in range(4)]
    requests = [
        AdmitRequest(urls[0], [1, 1, 1, 1]),  # first attempts: never refused
        AdmitRequest(urls[1], [2, 3, 2, 4]),  # retries past the default limit (2)
        AdmitRequest(urls[2], [2, 2, 2], limit=1),  # the endpoint's own limit
        AdmitRequest(urls[3], [1, 2]),  # its breaker is open (below)
    ]
    results = {}
    for name, many in (("many", True), ("each", False)):
        gate = make_gate(redis_client, f"{prefix}{name}:")
        opened = (await gate.admit(urls[3], [1, 1]))[:2]
        await gate.report(urls[3], [(opened[0], False), (opened[1], False)])
        if many:
            results[name] = await gate.admit_many(requests)
        else:
            results[name] = [await gate.admit(r.url, r.attempts, limit=r.limit) for r in requests]
    assert [_shape(d) for d in results["many"]] == [_shape(d) for d in results["each"]]
    assert (
        _shape(results["many"][1]) == [(True, "", False)] * 2 + [(False, "rate_limited", False)] * 2
    )
    assert [a.allowed for a in results["many"][2]] == [True, False, False]
    assert [a.reason for a in results["many"][3]] == ["circuit_open"] * 2
    # The same keys, each URL's own.
    for name in ("many", "each"):
        counts = [await redis_client.zcard(rate_limit_key(u, f"{prefix}{name}:")) for u in urls]
        assert counts == [4, 2, 1, 2]
        state = await redis_client.hget(breaker_key(urls[3], f"{prefix}{name}:"), "state")
        assert state == b"open"


async def test_rate_limited_attempts_are_counted(redis_client: Redis, prefix: str) -> None:
    gate = make_gate(redis_client, prefix, breaker_threshold=0)
    name = "fluxora_webhook_rate_limit_deferrals_total"
    before = REGISTRY.get_sample_value(name) or 0.0
    urls = [f"https://c{i}.example/{secrets.token_hex(4)}" for i in range(3)]
    decided = await gate.admit_many([AdmitRequest(u, [2, 2, 2]) for u in urls])
    assert [[a.allowed for a in d] for d in decided] == [[True, True, False]] * 3
    assert (REGISTRY.get_sample_value(name) or 0.0) - before == 3


async def test_a_redis_that_is_down_admits_the_whole_batch() -> None:
    client = Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)
    gate = make_gate(client, "down:", failure_backoff_ms=0)
    try:
        decided = await gate.admit_many(
            [AdmitRequest("https://a.example/", [2, 2, 2]), AdmitRequest("https://b.example/", [1])]
        )
    finally:
        await client.aclose()
    assert decided == [[ALLOW] * 3, [ALLOW]]
    assert not gate.available
