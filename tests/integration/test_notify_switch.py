"""What `run` says at its start about its database (no endpoint to deliver to; the wake-up
off), and the producers' wake-up NOTIFY left out (`fluxora.notify = off`, migration 0012)
for a transaction, a session, a role or a database, so that high-rate producers can share
their commits' flushes; idle dispatchers then find the events at their poll."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from fluxora_webhooks import endpoints
from fluxora_webhooks.outbox import enqueue
from fluxora_webhooks.service import (
    warn_if_not_vacuumed,
    warn_if_nowhere_to_deliver,
    warn_if_wake_up_off,
)
from tests.support.api import LOOPBACK
from tests.support.dispatch import make_settings, running_dispatcher
from tests.support.receiver import Receiver

pytestmark = pytest.mark.integration


async def _first_notification(listener: psycopg.AsyncConnection[Any]) -> str:
    async with asyncio.timeout(5):
        async for note in listener.notifies():
            return note.payload
    raise AssertionError("the notification stream ended")


async def _insert(url: str, setting: str | None) -> None:
    async with await psycopg.AsyncConnection.connect(url) as conn, conn.transaction():
        if setting is not None:
            await conn.execute("SELECT set_config('fluxora.notify', %s, true)", (setting,))
        await enqueue(conn, stream_id="s", event_type="stream.updated", payload={})


async def _sentinel(url: str) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute("SELECT pg_notify('webhook_outbox', 'sentinel')")


@pytest.mark.parametrize("setting", ["off", "OFF", "false", "0"])
async def test_a_transaction_with_the_wake_up_off_notifies_nobody(
    database_url: str, setting: str
) -> None:
    """Notifications arrive in commit order: the first one the listener gets after the
    switched-off commit is the sentinel committed after it."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as listener:
        await listener.execute("LISTEN webhook_outbox")
        await _insert(database_url, setting)
        await _sentinel(database_url)
        assert await _first_notification(listener) == "sentinel"


@pytest.mark.parametrize("setting", [None, "on", ""])
async def test_unset_or_on_the_wake_up_is_sent(database_url: str, setting: str | None) -> None:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as listener:
        await listener.execute("LISTEN webhook_outbox")
        await _insert(database_url, setting)
        await _sentinel(database_url)
        assert await _first_notification(listener) == ""


async def test_idle_dispatchers_find_unannounced_events_at_their_poll(
    database_url: str, receiver: Receiver
) -> None:
    """The events were announced to nobody (the listener's first notification after them
    is the sentinel), and the idle dispatcher delivered them all the same."""
    settings = make_settings(receiver.url, poll_interval_ms=200)
    async with (
        await psycopg.AsyncConnection.connect(database_url, autocommit=True) as listener,
        running_dispatcher(settings, database_url),
    ):
        await listener.execute("LISTEN webhook_outbox")
        await asyncio.sleep(0.3)  # the claim loops are idle, waiting for a wake-up
        for _ in range(3):
            await _insert(database_url, "off")
        await receiver.wait_for(3)
        await _sentinel(database_url)
        assert await _first_notification(listener) == "sentinel"
    assert len(receiver.received) == 3


@pytest.mark.parametrize(
    ("setting", "poll_ms", "warned"),
    [("off", 10_000, True), ("off", 1_000, False), ("on", 10_000, False), (None, 10_000, False)],
)
async def test_run_warns_when_the_database_has_the_wake_up_off_and_the_poll_is_long(
    database_url: str,
    caplog: pytest.LogCaptureFixture,
    setting: str | None,
    poll_ms: int,
    warned: bool,
) -> None:
    """`ALTER DATABASE ... SET fluxora.notify = off` (here: the connection's own options,
    which the server applies the same way) is seen by `run` at its start."""
    url = database_url
    if setting is not None:
        url = make_conninfo(database_url, options=f"-c fluxora.notify={setting}")
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        assert await warn_if_wake_up_off(conn, poll_ms) is warned
    assert ("WEBHOOK_POLL_INTERVAL_MS" in caplog.text) is warned


@pytest.mark.parametrize("target", ["DATABASE", "ROLE"])
async def test_run_sees_the_wake_up_off_for_the_database_or_any_role(
    database_url: str, caplog: pytest.LogCaptureFixture, target: str
) -> None:
    """ALTER DATABASE, or ALTER ROLE of the producers' role (not run's own): run's session
    does not show the latter, the catalog does."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        cur = await conn.execute("SELECT current_database()")
        row = await cur.fetchone()
        assert row is not None
        database = row[0]
        scope = (
            f'DATABASE "{database}"'
            if target == "DATABASE"
            else f'ROLE fluxora_test_producer IN DATABASE "{database}"'
        )
        if target == "ROLE":
            await conn.execute(
                "DO $$ BEGIN CREATE ROLE fluxora_test_producer;"
                " EXCEPTION WHEN duplicate_object THEN NULL; END $$"
            )
        try:
            assert await warn_if_wake_up_off(conn, 10_000) is False
            await conn.execute(f"ALTER {scope} SET fluxora.notify = off")
            assert await warn_if_wake_up_off(conn, 10_000) is True
            assert "off for this database or one of its roles" in caplog.text
        finally:
            await conn.execute(f"ALTER {scope} RESET fluxora.notify")
            if target == "ROLE":
                await conn.execute("DROP ROLE fluxora_test_producer")


async def test_run_warns_when_it_has_no_endpoint_to_deliver_to(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """SPEC 10: with neither WEBHOOK_URL nor a registered endpoint, run starts and warns.
    The built-in default that this start leaves in the registry (a run with WEBHOOK_URL
    seen within a minute, or a disabled one) is an endpoint: the default tenant's events
    go to it and wait, not unrouted; one this start removes (none with it seen) is not."""
    waiting = "no endpoint is registered but the built-in default"
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        assert await warn_if_nowhere_to_deliver(conn, make_settings("")) is True
        assert "no endpoint to deliver to" in caplog.text
        assert await warn_if_nowhere_to_deliver(conn, make_settings("http://127.0.0.1:9/")) is False

        # Another run has WEBHOOK_URL (seen just now): default stays and its deliveries wait.
        await endpoints.sync_builtin(conn, endpoints.DEFAULT_ID, "http://127.0.0.1:9/")
        caplog.clear()
        assert await warn_if_nowhere_to_deliver(conn, make_settings("")) is True
        assert waiting in caplog.text
        assert "no endpoint to deliver to" not in caplog.text

        # None with it seen for a minute: this start removes it, the events are unrouted.
        await conn.execute("UPDATE webhook_builtin_seen SET seen_at = now() - interval '2 min'")
        caplog.clear()
        assert await warn_if_nowhere_to_deliver(conn, make_settings("")) is True
        assert "no endpoint to deliver to" in caplog.text
        assert waiting not in caplog.text

        # A disabled default is never removed at a start.
        await endpoints.disable(conn, endpoints.DEFAULT_ID)
        caplog.clear()
        assert await warn_if_nowhere_to_deliver(conn, make_settings("")) is True
        assert waiting in caplog.text

        await endpoints.create(
            conn, url="http://127.0.0.1:9/hook", tenant="acme", allowed_networks=LOOPBACK
        )
        caplog.clear()
        assert await warn_if_nowhere_to_deliver(conn, make_settings("")) is False
        assert not caplog.text


async def test_run_says_when_the_outbox_is_not_vacuumed(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Without autovacuum the outbox's dead row versions pile up and every claim slows
    (a soak run: p50 from 8 to 230 ms in 15 minutes); run says so at its start, naming why:
    the server's setting, or the table's own."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        cur = await conn.execute("SELECT current_setting('autovacuum') = 'off'")
        server_off = (await cur.fetchone()) == (True,)
        with caplog.at_level(logging.WARNING, logger="fluxora_webhooks"):
            assert await warn_if_not_vacuumed(conn) is server_off
            assert ("autovacuum = off" in caplog.text) is server_off
            caplog.clear()
            await conn.execute("ALTER TABLE webhook_outbox SET (autovacuum_enabled = false)")
            assert await warn_if_not_vacuumed(conn) is True
            assert "webhook_outbox has autovacuum_enabled = false" in caplog.text
            assert "VACUUM webhook_outbox" in caplog.text
            caplog.clear()
            await conn.execute("ALTER TABLE webhook_outbox RESET (autovacuum_enabled)")
            assert await warn_if_not_vacuumed(conn) is server_off
            assert "autovacuum_enabled" not in caplog.text
