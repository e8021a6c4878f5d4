"""A replayed dead letter is gated as a retry: `dlq replay --all` respects the retry rate."""

from __future__ import annotations

import pytest
from aiohttp import web

from fluxora_webhooks import deadletters
from fluxora_webhooks.redis_gate import connect_gate
from fluxora_webhooks.retry import RetryPolicy
from tests.support.dispatch import (
    enqueue_many,
    make_settings,
    pending,
    running_dispatcher,
    wait_until,
)
from tests.support.receiver import Receiver

pytestmark = pytest.mark.integration


async def test_replay_all_respects_the_retry_rate(
    database_url: str, redis_url: str, prefix: str, receiver: Receiver
) -> None:
    rps, events = 4, 12
    receiver.respond = lambda r: web.Response(status=410)  # everything dead-lettered
    await enqueue_many(database_url, events)
    settings = make_settings(receiver.url, batch_size=20, retry_rps=rps)
    policy = RetryPolicy(max_attempts=1, schedule_ms=(10,))
    gate = await connect_gate(
        redis_url, retry_rps=rps, breaker_threshold=0, breaker_reset_ms=1000,
        probe_ttl_ms=5000, prefix=prefix,
    )  # fmt: skip
    try:
        async with running_dispatcher(settings, database_url, gate=gate, policy=policy):
            await receiver.wait_for(events)
            await wait_until(lambda: _idle(database_url), what="dead-lettered")
            receiver.respond = None  # the consumer recovered
            replayed = await deadletters.replay(database_url, [], include_all=True)
            assert len(replayed) == events
            await receiver.wait_for(2 * events, timeout=30)
            await wait_until(lambda: _idle(database_url), what="replayed")
    finally:
        await gate.close()
    replays = sorted(r.at for r in receiver.received[events:])
    # No more than WEBHOOK_RETRY_RPS replays in any second (less the receipt latency).
    for i in range(len(replays) - rps):
        assert replays[i + rps] - replays[i] >= 0.95, replays[i : i + rps + 1]


async def _idle(database_url: str) -> bool:
    return await pending(database_url) == 0
