"""The API's probes for a container platform (docs/api.md): ``/healthz`` answers while the
process does, ``/readyz`` says whether the database answers through the pool, both without
a token and without a word about the deployment; a database that comes back makes the API
ready again by itself."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import psycopg
import pytest

from fluxora_webhooks.migrations import migrate
from tests.support.api import Api, serving
from tests.support.chaos import own_postgres_running

pytestmark = pytest.mark.integration


def api_app(api: Api) -> Any:
    """The running app (its pool) behind ``api``."""
    assert api.server is not None and api.server._server is not None
    return api.server._server.config.app


async def _probe(session: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, str], str]:
    # An answer, not a hang: a platform's probe has a timeout of its own.
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
        text = await resp.text()
    return resp.status, dict(resp.headers), text


async def test_the_api_is_live_and_says_when_its_database_is_not_there() -> None:
    with own_postgres_running() as pg:
        url = pg.url()
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            await migrate(conn)
        async with serving(url) as api, aiohttp.ClientSession() as session:
            for path in ("/healthz", "/readyz"):
                status, _, text = await _probe(session, api.url + path)
                assert (status, json.loads(text)) == (200, {"status": "ok"}), (path, text)

            # The tokens the API was started with are written out first: this server
            # commits asynchronously (synchronous_commit off), and a crash right after
            # their commit could lose them (a 401 once it is back).
            async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
                await conn.execute("CHECKPOINT")
            pg.stop("immediate")
            status, headers, text = await _probe(session, api.url + "/readyz")
            assert (status, json.loads(text)) == (503, {"status": "unavailable"}), text
            assert headers.get("Retry-After") == "1"
            status, _, text = await _probe(session, api.url + "/healthz")
            assert status == 200, text  # alive: a platform must not restart it for this

            pg.start()
            deadline = time.monotonic() + 30
            while (await _probe(session, api.url + "/readyz"))[0] != 200:
                assert time.monotonic() < deadline, "the API never became ready again"
                await asyncio.sleep(0.2)
            # The API itself serves again, with the same pool.
            assert (await api.get("/api/v1/endpoints")).status == 200


async def test_an_api_whose_connections_are_all_busy_is_still_ready(database_url: str) -> None:
    """Every pool connection serving a request is a loaded API, not an unready one: a
    platform that took it out of rotation for that would move its load to the others."""
    async with serving(database_url, pool_max=1) as api, aiohttp.ClientSession() as session:
        app = api_app(api)
        async with app.state.fluxora.pool.connection():  # the pool's one connection, held
            status, _, text = await _probe(session, api.url + "/readyz")
        assert (status, json.loads(text)) == (200, {"status": "ok"}), text


async def test_probes_at_once_on_a_busy_api_open_one_connection_of_their_own(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Probes need no token: fifty at once while every pooled connection is busy make one
    connection of the probe's own between them (its answer reused for a second), not fifty."""
    from fluxora_webhooks.api import app as api_module

    made = []
    real = api_module._own_connection

    async def counted(state: Any) -> bool:
        made.append(1)
        return await real(state)

    monkeypatch.setattr(api_module, "_own_connection", counted)
    async with serving(database_url, pool_max=1) as api, aiohttp.ClientSession() as session:
        held = api_app(api).state.fluxora.pool.connection()  # the pool's one connection
        async with held:
            answers = await asyncio.gather(
                *(_probe(session, api.url + "/readyz") for _ in range(50))
            )
    assert [status for status, _, _ in answers] == [200] * 50
    assert len(made) == 1
