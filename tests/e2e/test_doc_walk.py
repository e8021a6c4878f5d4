"""What the documentation promises a newcomer, where a walk through it found the code
doing otherwise."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import aiohttp
import pytest

from fluxora_webhooks.demo.dashboard import start_dashboard
from tests.support.dispatch import wait_until
from tests.support.procs import dispatcher_env, start_dispatcher
from tests.support.receiver import Receiver


@pytest.mark.e2e
async def test_the_demo_dashboard_takes_a_free_port_when_its_own_is_taken(
    database_url: str, redis_url: str
) -> None:
    """`demo --help`: the dashboard listens on WEBHOOK_API_PORT (default 8080) "or a free
    port": a port already taken is no reason for the demo to fail after its checks held."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = await start_dashboard(database_url, redis_url, "127.0.0.1", port)
        try:
            assert server.port != port
            async with (
                aiohttp.ClientSession() as http,
                http.get(f"{server.url}healthz") as reply,
            ):
                assert reply.status == 200
        finally:
            await server.stop()


@pytest.mark.e2e
async def test_every_line_of_a_supervised_run_is_json_with_a_short_secret(
    database_url: str, redis_url: str, redis_prefix: str, receiver: Receiver, tmp_path: Path
) -> None:
    """docs/operations.md: with LOG_FORMAT=json every line `run` writes, its workers'
    included, is one JSON object: also the warning a worker gives about a short secret
    while it reads its configuration."""
    env = dispatcher_env(
        database_url, redis_url, receiver.url, redis_prefix,
        WEBHOOK_WORKERS="2", LOG_FORMAT="json", WEBHOOK_SECRET="a-short-secret",
    )  # fmt: skip
    service = await start_dispatcher(env, tmp_path / "run.log")
    try:

        async def both_dispatching() -> bool:
            return service.log().count("dispatching (batch") == 2

        await wait_until(both_dispatching, timeout=30, what="two workers dispatching")
    finally:
        service.terminate()
        assert await service.wait(30) == 0
    lines = [line for line in service.log().splitlines() if line.strip()]
    not_json = []
    for line in lines:
        try:
            json.loads(line)
        except json.JSONDecodeError:
            not_json.append(line)
    assert not not_json, lines
    short = [r for r in map(json.loads, lines) if "is shorter than" in r["message"]]
    assert {r.get("worker") for r in short} >= {0, 1}, short
