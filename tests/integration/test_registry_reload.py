"""The registry's periodic reload with many endpoints: a row as it was last applied is not
checked and applied again (with tens of thousands of endpoints that held the dispatcher's
event loop for seconds every ten seconds, stalling every request and the gate's calls),
while a row changed without a NOTIFY, a removed one and a rotated-out secret's expiry are
all still taken up by the next reload."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg import sql

from fluxora_webhooks import dispatcher as dispatcher_module
from fluxora_webhooks import endpoints, urlpolicy
from fluxora_webhooks import targets as targets_module
from fluxora_webhooks.targets import Targets
from tests.support.api import LOOPBACK
from tests.support.dispatch import make_settings, running_dispatcher, wait_until
from tests.support.receiver import Receiver

pytestmark = pytest.mark.integration

SECRET = "whsec_" + "A" * 43 + "="
ENDPOINTS = 3000


async def test_a_reload_checks_only_the_rows_that_changed(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    checked: list[str] = []
    real = urlpolicy.validate_url

    def counting(url: str, *args: Any, **kwargs: Any) -> Any:
        checked.append(url)
        return real(url, *args, **kwargs)

    monkeypatch.setattr(targets_module, "validate_url", counting)
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO webhook_endpoints (id, tenant, url, secret)"
            " SELECT 'ep_' || g, 't' || (g %% 100), 'https://h' || g || '.example.com/', %s"
            " FROM generate_series(1, %s) g",
            (SECRET, ENDPOINTS),
        )
        registry = Targets({}, {})
        await registry.load_all(conn)
        assert len(checked) == ENDPOINTS and len(list(registry.all())) == ENDPOINTS
        checked.clear()
        await registry.load_all(conn)
        assert checked == []  # nothing changed: nothing checked again
        # Changed by SQL (no NOTIFY reaches this registry), removed, rotated with the old
        # secret kept until a moment ago.
        await conn.execute(
            "UPDATE webhook_endpoints SET url = 'https://moved.example.com/' WHERE id = 'ep_7'"
        )
        await conn.execute("DELETE FROM webhook_endpoints WHERE id = 'ep_8'")
        await conn.execute(
            "UPDATE webhook_endpoints SET secret_previous = %s,"
            " previous_until = clock_timestamp() + interval '300 milliseconds' WHERE id = 'ep_9'",
            ("whsec_" + "B" * 43 + "=",),
        )
        await registry.load_all(conn)
        assert sorted(checked) == ["https://h9.example.com/", "https://moved.example.com/"]
        moved, signing = registry.get("ep_7"), registry.get("ep_9")
        assert moved is not None and moved.url == "https://moved.example.com/"
        assert registry.get("ep_8") is None
        assert signing is not None and signing.signer.secrets == 2
        await conn.execute("SELECT pg_sleep(0.4)")
        await registry.load_all(conn)  # the same row, its old secret expired since
        signing = registry.get("ep_9")
        assert signing is not None and signing.signer.secrets == 1
        checked.clear()
        await registry.load_all(conn)
        assert checked == []


async def test_the_registry_is_read_on_a_read_only_database(
    database_url: str, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A standby, a server switched read-only: writing the built-in endpoints fails, and the
    registry is read all the same (it was not, for as long as the database refused)."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        ep, _ = await endpoints.create(conn, url=receiver.url, allowed_networks=LOOPBACK)
        name = (await (await conn.execute("SELECT current_database()")).fetchone() or [""])[0]
        await conn.execute(
            sql.SQL("ALTER DATABASE {} SET default_transaction_read_only = on").format(
                sql.Identifier(name)
            )
        )
    monkeypatch.setattr(dispatcher_module, "HOUSEKEEPING_S", 0.2)
    try:
        async with running_dispatcher(make_settings(receiver.url), database_url) as dispatcher:
            async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
                # Changed where no NOTIFY tells of it: only the periodic reload can see it.
                await conn.execute("SET default_transaction_read_only = off")
                await conn.execute("ALTER TABLE webhook_endpoints DISABLE TRIGGER USER")
                await conn.execute(
                    "UPDATE webhook_endpoints SET url = 'https://moved.example.com/' WHERE id = %s",
                    (ep.id,),
                )
                await conn.execute("ALTER TABLE webhook_endpoints ENABLE TRIGGER USER")

            async def moved() -> bool:
                target = dispatcher.targets.get(ep.id)
                return target is not None and target.url == "https://moved.example.com/"

            await wait_until(moved, timeout=5, what="the registry read again")
    finally:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            await conn.execute("SET default_transaction_read_only = off")
            await conn.execute(
                sql.SQL("ALTER DATABASE {} RESET default_transaction_read_only").format(
                    sql.Identifier(name)
                )
            )
