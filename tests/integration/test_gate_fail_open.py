"""RedisGate fails open when Redis is down, hung, slow or answers errors, and comes back
by itself when Redis does: no restart of the gate, no permanent "disabled" state."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from fluxora_webhooks.errors import ConfigError
from fluxora_webhooks.gate import ALLOW, Admission
from fluxora_webhooks.metrics import REGISTRY
from fluxora_webhooks.redis_gate import RedisGate, breaker_key, connect_gate, rate_limit_key
from tests.support.dispatch import wait_until
from tests.support.procs import free_port
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.integration

URL = "https://consumer.example/hooks"
PASSWORD = "s3cret-pw-" + secrets.token_hex(4)
RETRY_DENIED = Admission(False, delay_ms=1000, reason="rate_limited")
LOGGER = "fluxora_webhooks.redis_gate"


def fail_opens(component: str) -> float:
    labels = {"component": component}
    return REGISTRY.get_sample_value("fluxora_webhook_redis_fail_open_total", labels) or 0.0


def warnings_about_outage(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == LOGGER and r.levelno == logging.WARNING and "unavailable" in r.getMessage()
    ]


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(free_port(), tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def shared_redis(redis_client: Redis, prefix: str) -> AsyncIterator[tuple[Redis, str]]:
    """The shared Redis, with a key prefix of this test's own (deleted after, never flushed)."""
    yield redis_client, prefix


async def test_a_database_redis_does_not_have_is_a_configuration_error(
    tmp_path: Path,
) -> None:
    """Never cured by waiting: not an outage to fail open through for the whole run, over
    TCP (a cluster-aware client) and over a unix socket (a plain one) alike."""
    with tempfile.TemporaryDirectory(prefix="fxr") as short:
        server = RedisServer(free_port(), tmp_path, socket=Path(short) / "s")
        server.start()
        try:
            for url in (
                f"redis://127.0.0.1:{server.port}/99",
                f"unix://{server.socket}?db=99",
            ):
                with pytest.raises(ConfigError) as caught:
                    await connect_gate(
                        url, retry_rps=1, breaker_threshold=1, breaker_reset_ms=1_000,
                        probe_ttl_ms=1_000,
                    )  # fmt: skip
                assert caught.value.variable == "REDIS_URL", url
                assert "names a database this Redis does not have" in str(caught.value)
            gate = await connect_gate(
                f"unix://{server.socket}?db=3", retry_rps=1, breaker_threshold=1,
                breaker_reset_ms=1_000, probe_ttl_ms=1_000,
            )  # fmt: skip
            await gate.close()
        finally:
            server.stop()


async def test_a_closed_port_admits_everything_and_counts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = free_port()  # bound, then closed: nothing listens there
    gate_before, breaker_before = fail_opens("gate"), fail_opens("breaker")
    caplog.set_level(logging.INFO, logger=LOGGER)

    async with asyncio.timeout(10):  # never hangs
        gate = await connect_gate(
            f"redis://:{PASSWORD}@127.0.0.1:{port}/0",
            retry_rps=1,
            breaker_threshold=1,
            breaker_reset_ms=60_000,
            probe_ttl_ms=1_000,
            failure_backoff_ms=50,
        )
        try:
            for _ in range(4):
                assert await gate.admit(URL, [2, 2, 2, 1]) == [ALLOW] * 4
                await gate.report(URL, [(ALLOW, False)] * 3)
                # Past the back-off: the next admit tries Redis again (and fails again).
                await asyncio.sleep(0.08)
            assert not gate.available
        finally:
            await gate.close()

    assert fail_opens("gate") - gate_before == 4
    assert fail_opens("breaker") - breaker_before == 4
    # One warning for the whole outage, and never the password.
    assert len(warnings_about_outage(caplog)) == 1
    assert PASSWORD not in caplog.text
    assert all(PASSWORD not in str(r.args) for r in caplog.records)


async def test_a_silent_redis_times_out_then_is_left_alone_during_the_back_off() -> None:
    connections: list[asyncio.StreamWriter] = []

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        while await reader.read(4096):  # read everything, answer nothing
            pass

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    before = fail_opens("ratelimit")
    try:
        async with asyncio.timeout(10):
            gate = await connect_gate(
                f"redis://127.0.0.1:{port}",
                retry_rps=1,
                breaker_threshold=0,
                breaker_reset_ms=60_000,
                probe_ttl_ms=1_000,
                failure_backoff_ms=60_000,
            )
            try:
                assert not gate.available  # the start-up ping timed out
                tried = len(connections)
                assert tried >= 1
                for _ in range(20):
                    assert await gate.admit(URL, [2, 2]) == [ALLOW, ALLOW]
                # During the back-off the gate did not even connect.
                assert len(connections) == tried
            finally:
                await gate.close()
    finally:
        server.close()
        for writer in connections:
            writer.close()
        await server.wait_closed()
    assert fail_opens("ratelimit") - before == 20


@contextlib.asynccontextmanager
async def _frozen_after_a_decision(
    own_redis: RedisServer, *, failure_backoff_ms: int, timeout_ms: int
) -> AsyncIterator[tuple[RedisGate, float]]:
    """A gate on ``own_redis`` at rps 1 with a breaker, which decided once (of two retries,
    the second over the limit); then Redis is frozen (it accepts nothing, answers
    nothing). Yields the gate and the fail-open count before the freeze; thawed and closed
    on the way out."""
    gate = await connect_gate(
        f"redis://127.0.0.1:{own_redis.port}",
        retry_rps=1,
        breaker_threshold=1,
        breaker_reset_ms=60_000,
        probe_ttl_ms=1_000,
        failure_backoff_ms=failure_backoff_ms,
        timeout_ms=timeout_ms,
    )
    try:
        assert await gate.admit(URL, [2, 2]) == [ALLOW, RETRY_DENIED]
        own_redis.freeze()
        yield gate, fail_opens("gate")
    finally:
        own_redis.thaw()
        await gate.close()


async def test_without_back_off_every_call_is_still_bounded(own_redis: RedisServer) -> None:
    async with _frozen_after_a_decision(own_redis, failure_backoff_ms=0, timeout_ms=300) as (
        gate,
        before,
    ):
        async with asyncio.timeout(10):
            for _ in range(3):
                assert await gate.admit(URL, [2, 2]) == [ALLOW, ALLOW]
                await gate.report(URL, [(ALLOW, False)])
        assert fail_opens("gate") - before == 3
        own_redis.thaw()
        for _ in range(100):
            admissions = await gate.admit(URL, [2, 2])
            if admissions != [ALLOW, ALLOW]:
                break
            await asyncio.sleep(0.05)
        # Redis decides again: of two retries at rps 1, the second is over the limit.
        assert admissions[-1] == RETRY_DENIED
        assert gate.available


async def test_a_node_that_failed_is_tried_again_off_the_deliveries_path(
    own_redis: RedisServer,
) -> None:
    """Once a call to Redis timed out, the calls after its back-off do not wait out the
    bound again while it still hangs: each goes ahead without the gate at once, and a try
    in the background finds out when Redis answers (a dead cluster node held every batch,
    whatever its consumers' nodes, for the whole bound once per back-off)."""
    async with _frozen_after_a_decision(own_redis, failure_backoff_ms=50, timeout_ms=4_000) as (
        gate,
        before,
    ):
        async with asyncio.timeout(10):
            assert await gate.admit(URL, [2, 2]) == [ALLOW, ALLOW]  # waits the bound once
        assert not gate.available
        for _ in range(5):
            await asyncio.sleep(0.06)  # past the back-off
            # Far less than the 4 s bound: not tried inline (a PING is, in the background).
            async with asyncio.timeout(2):
                assert await gate.admit(URL, [2, 2]) == [ALLOW, ALLOW]
        assert fail_opens("gate") - before == 6
        own_redis.thaw()

        async def answers() -> bool:
            return gate.available

        await wait_until(answers, 15, "the background PING finding Redis again")
        # The call cut short at the freeze ran when Redis went on (as a call cut short
        # does): its retry is in this second's window. Past it, Redis decides again: of two
        # retries at rps 1, the second is over the limit.
        await asyncio.sleep(1.1)
        assert await gate.admit(URL, [2, 2]) == [ALLOW, RETRY_DENIED]


async def test_error_answers_fail_open_and_protection_resumes(
    shared_redis: tuple[Redis, str],
) -> None:
    client, prefix = shared_redis
    gate = RedisGate(
        client,
        retry_rps=1,
        breaker_threshold=2,
        breaker_reset_ms=60_000,
        probe_ttl_ms=1_000,
        prefix=prefix,
        failure_backoff_ms=0,
    )
    # Keys of the wrong type make every script call answer WRONGTYPE.
    await client.set(rate_limit_key(URL, prefix), "not a sorted set")
    await client.set(breaker_key(URL, prefix), "not a hash")
    gate_before, breaker_before = fail_opens("gate"), fail_opens("breaker")

    assert await gate.admit(URL, [2, 2, 2]) == [ALLOW] * 3
    await gate.report(URL, [(ALLOW, False)] * 2)

    assert fail_opens("gate") - gate_before == 1
    assert fail_opens("breaker") - breaker_before == 1
    # Redis answered (refusing those calls): no outage, so no back-off for other consumers.
    assert gate.available

    await client.delete(rate_limit_key(URL, prefix), breaker_key(URL, prefix))
    assert await gate.admit(URL, [2, 2]) == [ALLOW, RETRY_DENIED]
    assert gate.available
    await gate.report(URL, [(ALLOW, False)] * 2)
    assert [a.reason for a in await gate.admit(URL, [1])] == ["circuit_open"]


async def test_redis_restart_fail_open_then_protection_resumes(
    own_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    gate = await connect_gate(
        f"redis://127.0.0.1:{own_redis.port}/0",
        retry_rps=2,
        breaker_threshold=1,
        breaker_reset_ms=60_000,
        probe_ttl_ms=1_000,
        failure_backoff_ms=100,
    )
    try:
        assert gate.available
        assert await gate.admit(URL, [2, 2, 2]) == [ALLOW, ALLOW, RETRY_DENIED]

        await asyncio.to_thread(own_redis.stop)
        before = fail_opens("gate"), fail_opens("breaker")
        for _ in range(5):
            admissions = await gate.admit(URL, [2, 2, 2])
            assert admissions == [ALLOW] * 3
            await gate.report(URL, [(a, False) for a in admissions])
            await asyncio.sleep(0.03)
        assert fail_opens("gate") - before[0] == 5
        assert fail_opens("breaker") - before[1] == 5
        assert not gate.available

        await asyncio.to_thread(own_redis.start)  # same port, empty data
        for _ in range(200):
            admissions = await gate.admit(URL, [2, 2, 2])
            if admissions != [ALLOW] * 3:
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("the gate never used Redis again after its restart")

        # Same gate, same client: the rate limit and the breaker protect again.
        assert admissions == [ALLOW, ALLOW, RETRY_DENIED]
        assert gate.available
        await gate.report(URL, [(admissions[0], False)])
        assert [a.reason for a in await gate.admit(URL, [1, 2])] == ["circuit_open"] * 2
    finally:
        await gate.close()

    assert len(warnings_about_outage(caplog)) == 1
    assert any("answers again" in r.getMessage() for r in caplog.records if r.name == LOGGER)
