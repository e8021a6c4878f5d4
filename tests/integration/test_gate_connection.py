"""The gate's own connection on a single Redis node: a script the server forgot is loaded
again, a connection that broke is reconnected within the same call (no fail-open), and a
call cut short by the gate's timeout leaves no reply behind for the next call to take."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from fluxora_webhooks.gate import ALLOW, Admission
from fluxora_webhooks.metrics import REGISTRY
from fluxora_webhooks.redis_gate import RedisGate, _pack_command, rate_limit_key
from tests.support.dispatch import wait_until
from tests.support.procs import free_port
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.integration

URL = "https://consumer.example/hooks"
OTHER = "https://other.example/hooks"
DENIED = Admission(False, delay_ms=1000, reason="rate_limited")


def fail_opens() -> float:
    labels = {"component": "ratelimit"}
    return REGISTRY.get_sample_value("fluxora_webhook_redis_fail_open_total", labels) or 0.0


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[Redis]:
    """A redis-server of the test's own (these tests flush, pause and kill on it)."""
    server = RedisServer(free_port(), tmp_path)
    server.start()
    redis = Redis(host="127.0.0.1", port=server.port)
    try:
        yield redis
    finally:
        await redis.aclose()
        server.stop()


def make_gate(client: Redis, **options: object) -> RedisGate:
    settings: dict[str, object] = {
        "retry_rps": 3,
        "breaker_threshold": 0,
        "breaker_reset_ms": 60_000,
        "probe_ttl_ms": 10_000,
        "failure_backoff_ms": 0,
        "timeout_ms": 2_000,
        **options,
    }
    return RedisGate(client, **settings)  # type: ignore[arg-type]


async def gate_connections(client: Redis) -> list[str]:
    """The ids of the server's client connections other than the asking one."""
    me = str(await client.client_id())
    return [str(c["id"]) for c in await client.client_list() if str(c["id"]) != me]


def test_a_command_is_packed_as_resp_bulk_strings() -> None:
    assert _pack_command(("EVALSHA", "ab", 2, "k", "é", -1)) == (
        b"*6\r\n$7\r\nEVALSHA\r\n$2\r\nab\r\n$1\r\n2\r\n$1\r\nk\r\n$2\r\n\xc3\xa9\r\n$2\r\n-1\r\n"
    )
    for wrong in (2.5, True, b"x"):
        with pytest.raises(TypeError, match="str or int"):
            _pack_command(("EVALSHA", wrong))  # type: ignore[arg-type]


async def test_calls_at_once_each_have_a_connection(client: Redis) -> None:
    port = client.connection_pool.connection_kwargs["port"]
    gate_client = Redis(host="127.0.0.1", port=port, client_name="gate")
    gate = make_gate(gate_client)

    async def gates() -> int:
        return sum(1 for c in await client.client_list() if c["name"] == "gate")

    try:
        # The first call loads the script through the client (a pooled connection, given
        # back); the gate keeps a connection of its own.
        assert await gate.admit(URL, [2]) == [ALLOW]
        await client.client_pause(300, all=False)  # write commands wait: the calls overlap
        decided = await asyncio.gather(*(gate.admit(f"{URL}/{i}", [2]) for i in range(3)))
        assert decided == [[ALLOW]] * 3
        assert await gates() == 3, "three calls at once, three connections"
        await asyncio.gather(*(gate.admit(f"{URL}/{i}", [2]) for i in range(3)))
        assert await gates() == 3, "kept and used again"
        await gate.close()
        assert await gates() == 0, "closed with the gate"
    finally:
        await gate.close()
        await gate_client.aclose()


async def test_a_forgotten_script_is_loaded_again(client: Redis) -> None:
    gate = make_gate(client)
    try:
        assert await gate.admit(URL, [2, 2]) == [ALLOW, ALLOW]
        await client.script_flush()  # as after a restart of the server
        before = fail_opens()
        assert await gate.admit(URL, [2, 2]) == [ALLOW, DENIED]
        assert fail_opens() == before
        assert await client.zcard(rate_limit_key(URL)) == 3
    finally:
        await gate.close()


async def test_a_broken_connection_is_reconnected_within_the_call(client: Redis) -> None:
    gate = make_gate(client)
    try:
        assert await gate.admit(URL, [2]) == [ALLOW]
        for connection in await gate_connections(client):
            await client.client_kill_filter(_id=connection)
        before = fail_opens()
        # Decided by Redis (the third retry is refused), not failed open.
        assert await gate.admit(URL, [2, 2, 2]) == [ALLOW, ALLOW, DENIED]
        assert fail_opens() == before
    finally:
        await gate.close()


async def test_a_call_cut_short_leaves_no_reply_for_the_next_one(client: Redis) -> None:
    gate = make_gate(client, timeout_ms=100)
    try:
        assert await gate.admit(OTHER, [2, 2, 2]) == [ALLOW, ALLOW, ALLOW]  # OTHER is full
        await client.client_pause(400, all=False)  # write commands wait
        before = fail_opens()
        # Times out while Redis holds it: failed open, counted. Redis runs it after the
        # pause, and its reply (five decisions) comes back on the connection it was sent on.
        assert await gate.admit(URL, [2] * 5) == [ALLOW] * 5
        assert fail_opens() == before + 1
        await asyncio.sleep(0.6)
        # Past the back-off, the first call goes ahead without the gate while a PING finds
        # out, in the background, that Redis answers (a batch never waits for that).
        assert await gate.admit(OTHER, [2]) == [ALLOW]
        assert fail_opens() == before + 2

        async def answers() -> bool:
            return gate.available

        await wait_until(answers, 5, "the gate using Redis again")
        # The answer to this call, not the late one: OTHER's window is full.
        assert await gate.admit(OTHER, [2]) == [DENIED]
        assert fail_opens() == before + 2
    finally:
        await gate.close()
