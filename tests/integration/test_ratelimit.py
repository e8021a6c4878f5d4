"""The shared retry rate limit of RedisGate, against the real Redis at 127.0.0.1:6379."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any, cast

import pytest
from redis.asyncio import Redis

from fluxora_webhooks.gate import ALLOW, Admission
from fluxora_webhooks.metrics import REGISTRY
from fluxora_webhooks.redis_gate import RedisGate, rate_limit_key, url_digest
from tests.support import gates
from tests.support.gates import server_ms

pytestmark = pytest.mark.integration

URL = "https://consumer.example/hooks?tenant=1"
DENIED = Admission(False, delay_ms=1000, reason="rate_limited")


def make_gate(client: Redis, prefix: str, **overrides: Any) -> RedisGate:
    return gates.make_gate(
        client,
        prefix,
        **{
            "retry_rps": 3,
            "breaker_threshold": 0,
            "breaker_reset_ms": 60_000,
            "probe_ttl_ms": 10_000,
            **overrides,
        },
    )


async def scored(client: Redis, key: str) -> dict[bytes, float]:
    """The members of a sorted set with their scores."""
    entries = cast(list[tuple[bytes, float]], await client.zrange(key, 0, -1, withscores=True))
    return dict(entries)


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_retries_beyond_the_limit_are_deferred_by_one_window(
    redis_client: Redis, prefix: str
) -> None:
    gate = make_gate(redis_client, prefix)
    before = sample("fluxora_webhook_rate_limit_deferrals_total")

    admissions = await gate.admit(URL, [2, 3, 2, 4, 5])

    assert admissions == [ALLOW, ALLOW, ALLOW, DENIED, DENIED]
    assert sample("fluxora_webhook_rate_limit_deferrals_total") - before == 2
    # Deferred attempts are not recorded: they were not sent.
    assert await redis_client.zcard(rate_limit_key(URL, prefix)) == 3


async def test_first_attempts_are_counted_but_never_deferred(
    redis_client: Redis, prefix: str
) -> None:
    gate = make_gate(redis_client, prefix)

    assert await gate.admit(URL, [1] * 10) == [ALLOW] * 10
    assert await redis_client.zcard(rate_limit_key(URL, prefix)) == 10
    # The burst of first attempts fills the window: a retry now waits.
    assert await gate.admit(URL, [2]) == [DENIED]
    assert await gate.admit(URL, [1]) == [ALLOW]


async def test_a_batch_is_decided_in_order(redis_client: Redis, prefix: str) -> None:
    gate = make_gate(redis_client, prefix)
    assert await gate.admit(URL, [2, 2]) == [ALLOW, ALLOW]

    # 2 in the window: the retry takes the third place, the first attempts pass anyway.
    assert await gate.admit(URL, [2, 1, 2, 1]) == [ALLOW, ALLOW, DENIED, ALLOW]
    assert await redis_client.zcard(rate_limit_key(URL, prefix)) == 5


async def test_members_are_scored_with_the_redis_server_clock(
    redis_client: Redis, prefix: str
) -> None:
    gate = make_gate(redis_client, prefix)
    start = await server_ms(redis_client)
    await gate.admit(URL, [1, 2])
    end = await server_ms(redis_client)

    entries = await scored(redis_client, rate_limit_key(URL, prefix))
    assert len(entries) == 2
    assert all(start <= score <= end for score in entries.values())


async def test_the_window_slides(redis_client: Redis, prefix: str) -> None:
    gate = make_gate(redis_client, prefix, retry_rps=2, window_ms=300)
    key = rate_limit_key(URL, prefix)
    assert await gate.admit(URL, [2, 2, 2]) == [
        ALLOW,
        ALLOW,
        Admission(False, delay_ms=300, reason="rate_limited"),
    ]
    oldest = min((await scored(redis_client, key)).values())

    for _ in range(1000):
        if await gate.admit(URL, [2]) == [ALLOW]:
            break
        await asyncio.sleep(0.01)
    else:
        pytest.fail("the retry was still deferred long after the window")

    # The retry passed only once the oldest attempt had left the window.
    newest = max((await scored(redis_client, key)).values())
    assert newest >= oldest + 300
    assert await redis_client.zcard(key) <= 2


async def test_the_set_expires_one_window_after_its_last_attempt(
    redis_client: Redis, prefix: str
) -> None:
    gate = make_gate(redis_client, prefix, window_ms=800)
    await gate.admit(URL, [1])
    ttl = await redis_client.pttl(rate_limit_key(URL, prefix))
    assert 0 < ttl <= 800


async def test_instances_share_one_limit(redis_client: Redis, prefix: str) -> None:
    other_client = Redis(host="127.0.0.1", port=6379)
    try:
        first, second = make_gate(redis_client, prefix), make_gate(other_client, prefix)
        assert await first.admit(URL, [2, 2]) == [ALLOW, ALLOW]
        assert await second.admit(URL, [2, 2]) == [ALLOW, DENIED]
        assert await first.admit(URL, [2]) == [DENIED]
    finally:
        await other_client.aclose()


async def test_keys_are_the_full_digest_of_the_full_url(redis_client: Redis, prefix: str) -> None:
    digest = hashlib.sha256(URL.encode()).hexdigest()
    assert url_digest(URL) == digest
    assert rate_limit_key(URL, prefix) == f"{prefix}webhook_rl:{{{digest}}}"
    assert rate_limit_key(URL) == f"webhook_rl:{{{digest}}}"

    gate = make_gate(redis_client, prefix)
    await gate.admit(URL, [1])
    keys = [key.decode() async for key in redis_client.scan_iter(match=f"{prefix}*")]
    assert keys == [f"{prefix}webhook_rl:{{{digest}}}"]


async def test_a_crafted_url_cannot_touch_another_consumers_limit(
    redis_client: Redis, prefix: str
) -> None:
    gate = make_gate(redis_client, prefix)
    victim_digest = url_digest(URL)
    crafted = [
        f"https://evil.example/{victim_digest}",
        f"https://evil.example/}}{victim_digest}{{",
        URL + " ",
        URL.upper(),
    ]
    for url in crafted:
        assert rate_limit_key(url, prefix) != rate_limit_key(URL, prefix)
        await gate.admit(url, [2] * 5)

    assert await redis_client.exists(rate_limit_key(URL, prefix)) == 0
    assert await gate.admit(URL, [2, 2, 2]) == [ALLOW] * 3


async def test_empty_batch_needs_no_redis(redis_client: Redis, prefix: str) -> None:
    gate = make_gate(redis_client, prefix)
    assert await gate.admit(URL, []) == []


@pytest.mark.parametrize(
    "overrides",
    [
        {"retry_rps": 0},
        {"window_ms": 0},
        {"breaker_threshold": -1},
        {"prefix": "tenant{a}:"},
        {"prefix": "half{"},
    ],
)
async def test_invalid_options_are_refused(redis_client: Redis, overrides: dict[str, Any]) -> None:
    options = dict(overrides)
    with pytest.raises(ValueError):
        make_gate(redis_client, options.pop("prefix", ""), **options)
