"""A pool with no connection free answers every waiting request 503 (with Retry-After),
and the log says so once, then as counts (api/errors.py, UNAVAILABLE_LOG_EVERY_S): a flood
of such answers is never a flood of lines, and no answer goes uncounted."""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

import pytest

from fluxora_webhooks.api import errors
from tests.support.api import Api, serving
from tests.support.dispatch import wait_until

pytestmark = pytest.mark.integration

WAIT_S = 20.0
LOGGER = "fluxora_webhooks.api"
LINE = "GET /api/v1/stats: answered 503, the database is not available (PoolTimeout); try again"
SUMMARY = re.compile(r"^(\d+) more answered 503 since the last such line \(the last: (.*)\)$")
AND_MORE = re.compile(r" \(and (\d+) more since the last such line\)$")


def _pool(api: Api) -> Any:
    assert api.server is not None and api.server._server is not None
    app: Any = api.server._server.config.app
    return app.state.fluxora.pool


def _said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == LOGGER and r.levelno == logging.WARNING and "answered 503" in r.getMessage()
    ]


def _accounted(lines: list[str]) -> int:
    """The 503 answers the lines account for: one each, plus the counts they carry."""
    total = 0
    for line in lines:
        summary = SUMMARY.match(line)
        if summary:
            assert summary.group(2) == LINE, line
            total += int(summary.group(1))
            continue
        more = AND_MORE.search(line)
        assert line.removesuffix(more.group(0) if more else "") == LINE, line
        total += 1 + (int(more.group(1)) if more else 0)
    return total


async def test_an_exhausted_pool_answers_503_each_time_and_logs_counts_not_floods(
    database_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    monkeypatch.setattr(errors, "UNAVAILABLE_LOG_EVERY_S", 3600.0, raising=False)
    async with serving(database_url, pool_max=1) as api:
        pool = _pool(api)
        pool.timeout = 0.2  # a request waits this long for a connection, then 503
        answered = 0

        async def flood(n: int) -> None:
            nonlocal answered
            replies = await asyncio.wait_for(
                asyncio.gather(*(api.get("/api/v1/stats", token="acme") for _ in range(n))),
                WAIT_S,
            )
            for reply in replies:
                assert reply.status == 503, reply.text
                assert reply.error_code == "unavailable"
                assert reply.headers.get("retry-after") == str(errors.RETRY_AFTER_S)
            answered += n

        async with pool.connection():  # the pool's one connection, held
            # Twenty answers, one line: the first.
            await flood(20)
            assert _said(caplog) == [LINE]

            # The time shortened: the next line carries the nineteen not said.
            monkeypatch.setattr(errors, "UNAVAILABLE_LOG_EVERY_S", 0.0, raising=False)
            await flood(1)
            assert _said(caplog) == [LINE, f"{LINE} (and 19 more since the last such line)"]

            # A short time: whatever the timing, every answer is accounted for once the
            # time is over, by lines or by the counts said at its end.
            monkeypatch.setattr(errors, "UNAVAILABLE_LOG_EVERY_S", 0.3, raising=False)
            await flood(10)

            async def all_accounted() -> bool:
                await asyncio.sleep(0.05)
                return _accounted(_said(caplog)) == answered

            await wait_until(all_accounted, timeout=WAIT_S, what="every 503 accounted")
            assert _accounted(_said(caplog)) == answered == 31

        # A connection free again: answered as usual.
        reply = await api.get("/api/v1/stats", token="acme")
        assert reply.status == 200, reply.text
