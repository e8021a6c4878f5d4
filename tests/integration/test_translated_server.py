"""A server whose messages are in another language (``lc_messages``): a failed connection
carries only the server's words, so start-up cannot tell a full or starting server from a
refusal by English text. A German server out of connection slots stopped `run` at once
("tut mir leid, schon zu viele Verbindungen"); it is waited for now, as in English. And an
API read stopped by its statement timeout was a 503 (retried) rather than the 422 that
says to ask for less."""

from __future__ import annotations

import asyncio
import logging
import subprocess
from collections.abc import Iterator

import psycopg
import pytest

from fluxora_webhooks.api import app as api_app
from fluxora_webhooks.migrations import migrate
from fluxora_webhooks.service import wait_for_database
from tests.support.api import serving
from tests.support.chaos import OwnPostgres, own_postgres_running

pytestmark = pytest.mark.integration

LOCALE = "de_DE.UTF-8"


def _has_locale(name: str) -> bool:
    """Whether the machine has ``name`` (`make locales` generates it)."""
    found = subprocess.run(["locale", "-a"], capture_output=True, text=True, check=False)
    wanted = name.lower().replace("-", "")
    return any(line.lower().replace("-", "") == wanted for line in found.stdout.split())


def _german_server(settings: str) -> Iterator[OwnPostgres]:
    if not _has_locale(LOCALE):  # fails, never skips: `make test` generates it
        pytest.fail(f"the {LOCALE} locale is not generated here: run `make locales` (as root)")
    with own_postgres_running(f"{settings} -c lc_messages={LOCALE}") as pg:
        yield pg


@pytest.fixture
def german_full_server() -> Iterator[OwnPostgres]:
    yield from _german_server("-c max_connections=3 -c superuser_reserved_connections=0")


@pytest.fixture
def german_server() -> Iterator[OwnPostgres]:
    yield from _german_server("-c max_connections=50")


async def test_a_translated_server_out_of_slots_is_waited_for(
    german_full_server: OwnPostgres, caplog: pytest.LogCaptureFixture
) -> None:
    url = german_full_server.url()
    held = [await psycopg.AsyncConnection.connect(url) for _ in range(3)]
    with pytest.raises(psycopg.OperationalError) as refused:
        await psycopg.AsyncConnection.connect(url)
    assert "zu viele Verbindungen" in str(refused.value)  # the server speaks German

    caplog.set_level(logging.WARNING, logger="fluxora_webhooks.service")
    waiting = asyncio.create_task(wait_for_database(url, 60_000, asyncio.Event()))
    try:
        while "database not reachable yet" not in caplog.text:
            assert not waiting.done(), waiting.result()  # raised: the refusal was fatal
            await asyncio.sleep(0.05)
        assert "zu viele Verbindungen" in caplog.text  # the server's own words, logged
    finally:
        for slot in held:
            await slot.close()
    conn = await waiting
    assert conn is not None
    await conn.close()


async def test_an_api_read_past_its_timeout_is_a_422_in_any_language(
    german_server: OwnPostgres, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = german_server.url()
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await migrate(conn)
    monkeypatch.setattr(api_app, "READ_STATEMENT_TIMEOUT_MS", 300, raising=False)
    async with serving(url) as api, await psycopg.AsyncConnection.connect(url) as holder:
        # Every read of the outbox waits behind this lock: longer than a read may take.
        await holder.execute("LOCK TABLE webhook_outbox IN ACCESS EXCLUSIVE MODE")
        reply = await api.get("/api/v1/deliveries", token="acme")
        await holder.rollback()
    assert reply.status == 422, reply.text
    assert reply.error_code == "query_timeout", reply.text
