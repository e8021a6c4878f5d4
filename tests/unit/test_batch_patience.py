"""How long a batch waits for its requests (SPEC 11): a request to an endpoint that has
not answered while the rest of the batch has is a straggler, detached after a grace of a
few times what the batch took, not after the whole patience; requests to an endpoint that
answers are waited for; with nothing answered the batch waits its patience."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any, cast

import pytest

from fluxora_webhooks import batch as batch_module
from fluxora_webhooks.batch import Batch, Send
from fluxora_webhooks.delivery import AttemptResult


def _send(endpoint: str, seconds: float | None) -> Send:
    """A send to ``endpoint`` whose request ends after ``seconds`` (None: never)."""

    async def request() -> AttemptResult:
        await asyncio.sleep(3600 if seconds is None else seconds)
        return cast(AttemptResult, None)

    send = Send(cast(Any, None), cast(Any, SimpleNamespace(id=endpoint)), cast(Any, None))
    send.task = asyncio.create_task(request())
    return send


async def _waited(sends: list[Send]) -> float:
    batch = Batch(cast(Any, None))
    start = time.monotonic()
    try:
        await batch._wait(sends)
        return time.monotonic() - start
    finally:
        for send in sends:
            assert send.task is not None
            send.task.cancel()


async def test_a_straggler_is_not_waited_for_the_whole_patience(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(batch_module, "PATIENCE_S", 30.0)
    sends = [_send("fast", 0.0) for _ in range(5)] + [_send("hanging", None)]
    assert await _waited(sends) < 5.0
    assert sends[-1].task is not None and not sends[-1].task.done()


async def test_an_endpoint_that_answered_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch_module, "PATIENCE_S", 30.0)
    sends = [_send("fast", 0.0), _send("slower", 0.0), _send("slower", 0.3)]
    await _waited(sends)
    assert all(s.task is not None and s.task.done() for s in sends)


async def test_with_no_answer_the_batch_waits_its_patience(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(batch_module, "PATIENCE_S", 0.3)
    sends = [_send("a", None), _send("b", None)]
    assert await _waited(sends) >= 0.3
