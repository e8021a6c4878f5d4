"""What a worker tells its supervisor about its commits (the pipe the supervisor logs and
answers /readyz from): ``stuck <reason>`` once a COMMIT has waited too long, ``flowing``
once commits complete again, and not ``flowing`` when the wait ended because a stop
abandoned the batch (its commit was cancelled, not completed); ``alive`` every check with
nothing else to say (a heartbeat: the supervisor stops counting a silent worker)."""

from __future__ import annotations

import asyncio
import os
from typing import cast

import pytest

from fluxora_webhooks import worker
from fluxora_webhooks.service import COMMIT_STUCK_S, Service

TICK_S = 0.01


class _Dispatcher:
    def __init__(self) -> None:
        self.ready = asyncio.Event()
        self.wait_s = 0.0

    def commit_wait_s(self) -> float:
        return self.wait_s


class _Service:
    def __init__(self) -> None:
        self.dispatcher = _Dispatcher()
        self.abandoned = False


async def _lines(monkeypatch: pytest.MonkeyPatch, end: str) -> list[str]:
    """The lines a worker writes while a commit waits past the bound and then ends: it
    completes (``end="completed"``), or a stop abandons its batch (``"abandoned"``); its
    heartbeats left out (see :func:`_written`)."""
    return [line for line in await _written(monkeypatch, end) if line != "alive"]


async def _written(monkeypatch: pytest.MonkeyPatch, end: str) -> list[str]:
    monkeypatch.setattr(worker, "COMMIT_CHECK_S", TICK_S)
    service = _Service()
    read_fd, write_fd = os.pipe()
    task = asyncio.create_task(worker._report_ready(cast(Service, service), write_fd))
    try:
        service.dispatcher.ready.set()
        await asyncio.sleep(TICK_S * 5)
        service.dispatcher.wait_s = COMMIT_STUCK_S + 2
        await asyncio.sleep(TICK_S * 5)
        if end == "abandoned":
            service.abandoned = True  # Service._drain, just before it cancels the batch
        service.dispatcher.wait_s = 0.0  # the batch's commit_ended, either way
        await asyncio.sleep(TICK_S * 5)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)  # closes write_fd
    with os.fdopen(read_fd, "rb") as pipe:
        return pipe.read().decode().splitlines()


async def test_a_commit_that_completes_again_is_reported_flowing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lines = await _lines(monkeypatch, "completed")
    assert lines[0] == "ready"
    assert lines[1].startswith("stuck a commit has waited 12 s"), lines
    assert lines[2:] == ["flowing"]


async def test_a_commit_cancelled_by_an_abandoning_stop_is_not_reported_flowing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A SIGTERM during a synchronous-replication stall: the drain bound abandons the batch
    and PostgreSQL cancels the commit's wait. The supervisor must not hear ``flowing``
    (it would log "its commits complete again"): the last word stays ``stuck``."""
    lines = await _lines(monkeypatch, "abandoned")
    assert lines[0] == "ready"
    assert lines[1].startswith("stuck a commit has waited 12 s"), lines
    assert lines[2:] == [], lines


async def test_a_worker_says_it_is_alive_at_each_check_with_nothing_else_to_say(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lines = await _written(monkeypatch, "completed")
    assert lines[0] == "ready"
    said = [i for i, line in enumerate(lines) if line != "alive"]
    assert [lines[i].split()[0] for i in said] == ["ready", "stuck", "flowing"], lines
    # Between and after those: heartbeats, one per check (about five per phase).
    for start, end in zip(said, [*said[1:], len(lines)], strict=True):
        assert end - start - 1 >= 2, lines
