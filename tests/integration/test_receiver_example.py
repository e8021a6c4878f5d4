"""examples/receiver.py, started on loopback, receiving requests signed by ``Signer``."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from fluxora_webhooks.signing import Signer

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "receiver.py"
SECRET = "receiver-test-secret-0123456789"
OLD = "receiver-old-secret-0123456789a"
BODY = b'{"stream_id": "s-1", "amount": 3}'


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fluxora_example_receiver", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


receiver_module = load_example()


class Running:
    def __init__(self, app: web.Application, url: str, session: aiohttp.ClientSession) -> None:
        self.app = app
        self.url = url
        self.session = session

    @property
    def state(self) -> Any:
        return self.app[receiver_module.RECEIVER]

    async def post(self, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
        async with self.session.post(self.url, data=body, headers=headers) as response:
            return response.status, await response.json()

    async def drained(self) -> None:
        await asyncio.wait_for(self.state.queue.join(), 5)


Starter = Callable[..., Any]


@pytest.fixture
async def start() -> AsyncIterator[Starter]:
    runners: list[web.AppRunner] = []
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))

    async def starter(
        secret: str = SECRET, previous: str | None = None, queue_size: int = 100
    ) -> Running:
        app = receiver_module.make_app(secret, previous, queue_size=queue_size)
        runner = web.AppRunner(app)
        await runner.setup()
        runners.append(runner)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        return Running(app, f"http://{host}:{port}/webhooks", session)

    yield starter
    await session.close()
    for runner in runners:
        await runner.cleanup()


def signed(
    secret: str = SECRET,
    *,
    previous: str | None = None,
    delivery_id: str = "d-1",
    body: bytes = BODY,
    timestamp: int | None = None,
) -> dict[str, str]:
    return Signer(secret.encode(), previous.encode() if previous else None).headers(
        delivery_id=delivery_id,
        event_type="stream.updated",
        attempt=1,
        body=body,
        timestamp=int(time.time()) if timestamp is None else timestamp,
    )


def fluxora_only(headers: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if not k.startswith("webhook-")}


async def test_a_signed_delivery_is_accepted_and_processed(start: Starter) -> None:
    receiver = await start()
    status, answer = await receiver.post(BODY, signed())
    assert (status, answer) == (202, {"status": "accepted", "delivery_id": "d-1"})
    await receiver.drained()
    [event] = receiver.state.processed
    assert (event.delivery_id, event.event_type, event.body) == ("d-1", "stream.updated", BODY)


async def test_either_scheme_is_accepted(start: Starter) -> None:
    receiver = await start()
    assert (await receiver.post(BODY, fluxora_only(signed(delivery_id="fx"))))[0] == 202
    standard = {k: v for k, v in signed(delivery_id="std").items() if not k.startswith("x-")}
    assert (await receiver.post(BODY, standard))[0] == 202
    await receiver.drained()
    assert [e.delivery_id for e in receiver.state.processed] == ["fx", "std"]


async def test_a_duplicate_delivery_is_acknowledged_but_processed_once(start: Starter) -> None:
    receiver = await start()
    first = signed(delivery_id="dup-1")
    retry = signed(delivery_id="dup-1", timestamp=int(time.time()) + 1)  # a later attempt
    assert (await receiver.post(BODY, first))[0] == 202
    status, answer = await receiver.post(BODY, retry)
    assert (status, answer["status"]) == (200, "duplicate")
    status, answer = await receiver.post(BODY, first)
    assert (status, answer["status"]) == (200, "duplicate")
    await receiver.drained()
    assert [e.delivery_id for e in receiver.state.processed] == ["dup-1"]
    assert receiver.state.duplicates == 2


async def test_concurrent_copies_of_one_delivery_are_processed_once(start: Starter) -> None:
    receiver = await start()
    headers = signed(delivery_id="burst")
    results = await asyncio.gather(*(receiver.post(BODY, headers) for _ in range(20)))
    assert sorted(status for status, _ in results) == [200] * 19 + [202]
    await receiver.drained()
    assert len(receiver.state.processed) == 1


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("tampered body", "no_matching_signature"),
        ("wrong secret", "no_matching_signature"),
        ("stale", "timestamp_too_old"),
        ("unsigned", "missing_header"),
        ("tampered fluxora", "no_matching_signature"),
    ],
)
async def test_unverifiable_requests_are_refused(start: Starter, case: str, reason: str) -> None:
    receiver = await start()
    body, headers = BODY, signed(delivery_id="bad")
    if case == "tampered body":
        body = BODY.replace(b"3", b"4")
    elif case == "wrong secret":
        headers = signed("another-secret-altogether-000000", delivery_id="bad")
    elif case == "stale":
        headers = signed(delivery_id="bad", timestamp=int(time.time()) - 3600)
    elif case == "unsigned":
        headers = {"content-type": "application/json"}
    else:
        headers = fluxora_only(headers)
        body = BODY + b"\n"
    status, answer = await receiver.post(body, headers)
    assert (status, answer) == (401, {"error": reason})
    # A refused request does not take its delivery id: the genuine one is still accepted.
    assert (await receiver.post(BODY, signed(delivery_id="bad")))[0] == 202
    await receiver.drained()
    assert [e.delivery_id for e in receiver.state.processed] == ["bad"]


async def test_rotation_a_receiver_accepting_both_secrets(start: Starter) -> None:
    receiver = await start(SECRET, previous=OLD)
    before = fluxora_only(signed(OLD, delivery_id="before"))
    during = fluxora_only(signed(SECRET, previous=OLD, delivery_id="during"))
    assert (await receiver.post(BODY, before))[0] == 202
    assert (await receiver.post(BODY, during))[0] == 202
    assert (await receiver.post(BODY, signed(SECRET, previous=OLD, delivery_id="std")))[0] == 202
    on_old_only = await start(OLD)
    assert (await on_old_only.post(BODY, during))[0] == 401  # why consumers rotate first


async def test_a_full_queue_answers_503_and_forgets_the_id(start: Starter) -> None:
    receiver = await start(queue_size=1)
    started, release = asyncio.Event(), asyncio.Event()
    handled: list[str] = []

    async def slow_handle(event: Any) -> None:
        started.set()
        await release.wait()
        handled.append(event.delivery_id)

    receiver.state.handle = slow_handle
    assert (await receiver.post(BODY, signed(delivery_id="first")))[0] == 202
    await asyncio.wait_for(started.wait(), 5)  # the worker took it and is busy
    assert (await receiver.post(BODY, signed(delivery_id="queued")))[0] == 202
    status, answer = await receiver.post(BODY, signed(delivery_id="busy"))
    assert (status, answer) == (503, {"error": "busy"})
    release.set()
    await receiver.drained()
    # The refused delivery was not recorded as seen: its retry is accepted, not a duplicate.
    assert (await receiver.post(BODY, signed(delivery_id="busy")))[0] == 202
    await receiver.drained()
    assert handled == ["first", "queued", "busy"]


def test_main_requires_the_secret(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("WEBHOOK_SECRET", raising=False)
    assert receiver_module.main(["--port", "0"]) == 2
    assert "WEBHOOK_SECRET is required" in capsys.readouterr().err
