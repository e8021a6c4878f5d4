"""Building Redis gates in tests, and reading Redis's clock (the gate's clock)."""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis

from fluxora_webhooks.redis_gate import RedisGate


def make_gate(client: Redis, prefix: str, **options: Any) -> RedisGate:
    """A gate with a generous call timeout (a fail-open under load would blur the checks)."""
    return RedisGate(client, **{"prefix": prefix, "timeout_ms": 5_000, **options})


async def server_ms(client: Redis) -> int:
    seconds, micros = await client.time()
    return int(seconds) * 1000 + int(micros) // 1000
