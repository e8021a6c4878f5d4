"""``run`` (one process) serves the API in its own loop when WEBHOOK_API_PORT is set, and
stops it with the dispatcher's drain, within the drain bound."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import aiohttp
import pytest

from fluxora_webhooks.api.pagination import decode, decode_int, encode
from fluxora_webhooks.service import Service
from tests.support.api import LOOPBACK
from tests.support.dispatch import make_settings

pytestmark = pytest.mark.integration


async def test_run_serves_the_api_and_stops_it_with_the_drain(database_url: str) -> None:
    settings = dataclasses.replace(
        make_settings("", allowed_networks=LOOPBACK, secret=b""), api_port=0
    )
    service = Service(settings, database_url=database_url, redis_url=None)
    task = asyncio.create_task(service.run(install_signals=False))
    try:
        while service.api_port is None:  # set inside Service.run
            assert not task.done()
            await asyncio.sleep(0.05)
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{service.api_port}"
            async with session.get(url + "/api/v1/stats") as resp:
                assert resp.status == 401
            async with session.get(url + "/login") as resp:
                assert resp.status == 200 and "Sign in" in await resp.text()
    finally:
        started = time.monotonic()
        service.stop()
        await asyncio.wait_for(task, 15)
    assert time.monotonic() - started < settings.timeout_ms / 1000 + 5


def test_cursors_are_opaque_and_belong_to_their_list() -> None:
    cursor = encode("deliveries", 42)
    assert "42" not in cursor and decode_int("deliveries", cursor) == 42
    assert decode("endpoints", encode("endpoints", "ep_x")) == "ep_x"
    assert decode("endpoints", None) is None and decode("endpoints", "") is None
    for bad in (
        "%%%",
        encode("events", 1),
        encode("deliveries", "x"),
        "YQ",
        encode("deliveries", 2**63),
        encode("deliveries", "9" * 5000),  # past int()'s digits limit,
    ):
        with pytest.raises(Exception, match="cursor"):
            decode_int("deliveries", bad)
