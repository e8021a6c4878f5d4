"""What a DBA may have set for the database or the role (ALTER DATABASE / ALTER ROLE ...
SET) does not change what our sessions do: times are read in a DateStyle other than ISO,
batches are not sent twice under SERIALIZABLE by default, and floats are not rounded."""

from __future__ import annotations

import collections
import json
import logging
import re
from typing import Any

import psycopg
import pytest
from aiohttp import web
from psycopg import sql

from fluxora_webhooks import inbox
from fluxora_webhooks.outbox import enqueue
from fluxora_webhooks.pgtypes import open_session
from fluxora_webhooks.service import warn_if_wake_up_off
from tests.support.dispatch import SECRET, make_settings, running_dispatcher, scalar, wait_until
from tests.support.inbox import delivery
from tests.support.procs import command_env, run_command, run_json
from tests.support.receiver import Received, Receiver

pytestmark = pytest.mark.integration


def alter_database(database_url: str, **settings: str) -> None:
    """The database's own defaults, as a DBA sets them (new sessions take them)."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        name = conn.info.dbname
        for setting, value in settings.items():
            conn.execute(
                sql.SQL("ALTER DATABASE {} SET {} = {}").format(
                    sql.Identifier(name), sql.Identifier(setting), sql.Literal(value)
                )
            )


async def cli(env: dict[str, str], *args: str) -> tuple[int, Any]:
    return await run_json(*args, env=env)


async def test_commands_read_times_in_any_datestyle_and_floats_whole(database_url: str) -> None:
    """Under DateStyle 'SQL, DMY' every command that read a time failed, some after
    writing (an endpoint made, its secret never shown; a token made, never shown)."""
    alter_database(database_url, DateStyle="SQL, DMY", extra_float_digits="-15")
    env = command_env(DATABASE_URL=database_url)
    code, made = await cli(env, "endpoints", "add", "--url", "https://a.example.com/in", "--json")
    assert code == 0, made
    assert made["secret"].startswith("whsec_") and made["created_at"][4] == "-"
    code, token = await cli(env, "tokens", "create", "--name", "ops", "--json")
    assert code == 0 and token["token"], token
    for args in (
        ("endpoints", "list", "--json"),
        ("tokens", "list", "--json"),
        ("dlq", "list", "--json"),
        ("status", "--json"),
    ):
        code, out = await cli(env, *args)
        assert code == 0, (args, out)
    code, out = await cli(env, "recover", "--endpoint", made["id"], "--since", "1h")
    assert code == 0, out
    # The session's own setting is the database's: ours are set per session, not for it.
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        cur = await conn.execute("SHOW DateStyle")
        assert (await cur.fetchone()) == ("SQL, DMY",)
        cur = await conn.execute("SELECT (0.1::float8 * 3)::text")
        assert (await cur.fetchone()) == ("0.3",)  # -15 digits: rounded
    async with await open_session(database_url) as ours:
        cur = await ours.execute("SELECT (0.1::float8 * 3)::text, current_setting('DateStyle')")
        assert (await cur.fetchone()) == ("0.30000000000000004", "ISO, DMY")


async def test_the_inbox_receives_on_a_connection_in_another_datestyle(
    inbox_database_url: str,
) -> None:
    """The consumer's own connection, in its own DateStyle: receive reads no time back."""
    alter_database(inbox_database_url, DateStyle="SQL, DMY")
    event = delivery({"amount": 5})
    async with await psycopg.AsyncConnection.connect(inbox_database_url) as conn:
        got = await inbox.receive(conn, body=event.body, headers=event.headers, secret=SECRET)
        assert got is not None and got.delivery_id == event.delivery_id
        await conn.commit()
        again = await inbox.receive(conn, body=event.body, headers=event.headers, secret=SECRET)
        assert again is None


async def test_a_serializable_default_sends_no_batch_twice(
    database_url: str, receiver: Receiver
) -> None:
    """Under default_transaction_isolation = serializable the claim loops' transactions
    failed with serialization errors (logged as the database being unavailable) and their
    batches were sent again: a third more requests than deliveries."""
    alter_database(database_url, default_transaction_isolation="serializable")
    firsts: set[str] = set()

    def respond(request: Received) -> web.Response:
        delivery_id = request.delivery_id
        if delivery_id[-1] in "05a" and delivery_id not in firsts:  # some need a retry
            firsts.add(delivery_id)
            return web.Response(status=503)
        return web.Response(status=200)

    receiver.respond = respond
    total = 300
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        for i in range(total):
            await enqueue(conn, stream_id=f"s-{i}", event_type="thing.done", payload={"i": i})
        await conn.commit()
    settings = make_settings(receiver.url, claim_loops=4)
    async with running_dispatcher(settings, database_url):
        await wait_until(
            lambda: _delivered(database_url, total), timeout=60, what="every event delivered"
        )
    sent = collections.Counter((r.delivery_id, r.attempt) for r in receiver.received)
    assert [key for key, count in sent.items() if count > 1] == []
    assert len({delivery_id for delivery_id, _ in sent}) == total


async def _delivered(database_url: str, total: int) -> bool:
    done = await scalar(
        database_url, "SELECT count(*) FROM webhook_outbox WHERE outcome = 'delivered'"
    )
    return bool(done == total)


async def test_an_installation_off_the_search_path_is_named_not_migrated_again(
    empty_database_url: str,
) -> None:
    """Installed in a schema of its own (the URL's search_path), then reached by a URL or a
    role without it: the command names the schema and what to add; `migrate` says it makes
    a second installation."""
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA webhooks")
    own = empty_database_url + "?options=-c%20search_path%3Dwebhooks"
    code, out = await cli(command_env(DATABASE_URL=own), "migrate")
    assert code == 0, out
    code, out = await cli(command_env(DATABASE_URL=own), "status", "--json")
    assert code == 0, out

    code, out = await cli(command_env(DATABASE_URL=empty_database_url), "status")
    assert code == 3, out
    assert "schema webhooks of this database holds one" in out, out
    assert "add options=-c%20search_path%3Dwebhooks to DATABASE_URL" in out, out
    code, out = await cli(command_env(DATABASE_URL=empty_database_url), "migrate")
    assert code == 0 and "note: a second installation is made here" in out, out


async def test_run_refuses_workers_past_the_roles_connection_limit(
    database_url: str, redis_url: str, prefix: str
) -> None:
    """A role's CONNECTION LIMIT is a cap as max_connections is: `run` says so at start
    (a worker past it was restarted for ever, /readyz at 503)."""
    role = f"fluxora_cap_{prefix.strip(':').replace('-', '_')[-12:]}".lower()
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE ROLE {} LOGIN CONNECTION LIMIT 5").format(sql.Identifier(role))
        )
        for what in ("TABLES", "SEQUENCES"):
            conn.execute(
                sql.SQL("GRANT ALL ON ALL {} IN SCHEMA public TO {}").format(
                    sql.SQL(what), sql.Identifier(role)
                )
            )
    try:
        own = database_url.replace("postgres@", f"{role}@", 1)
        env = command_env(
            DATABASE_URL=own, REDIS_URL=redis_url, FLUXORA_REDIS_PREFIX=prefix, WEBHOOK_WORKERS="2"
        )
        code, out = await run_command("run", env=env, timeout=30)
        assert code == 2, out
        # (The last check's own connections may not have gone yet: "- 1 in use".)
        assert re.search(
            r"the role's CONNECTION LIMIT leaves [45] \(limit 5 - [01] in use\)", out
        ), out
        assert "ALTER ROLE ... CONNECTION LIMIT" in out, out
    finally:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


async def test_run_names_each_privilege_its_role_lacks_before_sending_anything(
    database_url: str, redis_url: str, prefix: str
) -> None:
    """Without INSERT on the dead letters a delivery that had to become one was sent again
    for ever, and /readyz said ready: `run` now stops at start, naming what to grant."""
    role = f"fluxora_lack_{prefix.strip(':').replace('-', '_')[-12:]}".lower()
    name = sql.Identifier(role)
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(name))
        for statement in (
            "GRANT SELECT ON fluxora_schema_migrations TO {}",
            "GRANT SELECT, INSERT, UPDATE ON webhook_outbox, webhook_builtin_seen TO {}",
            "GRANT SELECT, INSERT, UPDATE, DELETE ON webhook_endpoints TO {}",
            "GRANT SELECT ON webhook_dead_letter TO {}",  # no INSERT
            "GRANT USAGE ON SEQUENCE webhook_outbox_id_seq TO {}",  # not the dead letters'
        ):
            conn.execute(sql.SQL(statement).format(name))
    try:
        env = command_env(
            DATABASE_URL=database_url.replace("postgres@", f"{role}@", 1),
            REDIS_URL=redis_url,
            FLUXORA_REDIS_PREFIX=prefix,
            WEBHOOK_WORKERS="1",
            WEBHOOK_METRICS_PORT="0",
        )
        code, out = await run_command("run", env=env, timeout=30)
        assert code == 2, out
        assert f"its role {role} may not do what the dispatcher does" in out, out
        assert "INSERT on webhook_dead_letter; USAGE on webhook_dead_letter_id_seq" in out, out
    finally:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(name))
            conn.execute(sql.SQL("DROP ROLE {}").format(name))


TEXT = "Zoë 😀 日本"  # Latin-1, then past it


async def test_a_latin1_client_encoding_loses_no_character(
    database_url: str, receiver: Receiver
) -> None:
    """client_encoding LATIN1 for the database: enqueue's UTF-8 JSON was read by the server
    as LATIN1 and stored as mojibake, without an error; the dispatcher's claim of a payload
    holding an emoji failed for ever (untranslatable character), and the CLI wrote such
    text with a traceback."""
    alter_database(database_url, client_encoding="LATIN1")
    async with await psycopg.AsyncConnection.connect(database_url) as producer:
        assert producer.info.encoding != "utf-8"
        await enqueue(producer, stream_id="s-Zoë", event_type="thing.done", payload={"t": TEXT})
        await producer.commit()

    async with running_dispatcher(make_settings(receiver.url), database_url):
        await wait_until(lambda: _delivered(database_url, 1), timeout=30, what="the delivery")
    assert [json.loads(r.body) for r in receiver.received] == [{"t": TEXT}]

    async with await psycopg.AsyncConnection.connect(database_url) as producer:
        with pytest.raises(ValueError, match=r"client_encoding \(LATIN1\) cannot carry"):
            await enqueue(producer, stream_id="s-😀", event_type="thing.done", payload={})

    env = command_env(DATABASE_URL=database_url)
    code, made = await cli(
        env, "endpoints", "add", "--url", "https://a.example.com/in", "--description", TEXT,
        "--json",
    )  # fmt: skip
    assert code == 0 and made["description"] == TEXT, made
    async with await open_session(database_url) as ours:
        cur = await ours.execute("SELECT description FROM webhook_endpoints WHERE id = %s",
                                 (made["id"],))  # fmt: skip
        assert await cur.fetchone() == (TEXT,)


async def test_tables_of_the_same_names_ahead_on_the_search_path_are_named(
    database_url: str,
) -> None:
    """A schema ahead of the installation's on the search_path with tables of the same
    names: `run` claimed from those (a traceback per claim, for ever) and the commands
    failed on a column they lack; each now stops at start naming them (exit 3)."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA legacy")
        conn.execute("CREATE TABLE legacy.webhook_outbox (id bigserial, payload jsonb)")
        conn.execute(
            sql.SQL("ALTER DATABASE {} SET search_path = legacy, public").format(
                sql.Identifier(str(conn.info.dbname))
            )
        )
    code, out = await cli(command_env(DATABASE_URL=database_url), "endpoints", "list")
    assert code == 3, out
    assert (
        "finds legacy.webhook_outbox ahead of the fluxora-webhooks tables of schema"
        " public: put public first on the search_path" in " ".join(out.split())
    ), out


@pytest.mark.parametrize("setting", ["lock_timeout", "statement_timeout"])
async def test_a_statement_the_databases_timeout_cancels_is_not_called_unreachable(
    database_url: str, setting: str
) -> None:
    """A command's statement stopped by a lock_timeout or statement_timeout the DBA set
    said `cannot reach the database`: the database was reached."""
    alter_database(database_url, **{setting: "200ms"})
    async with await psycopg.AsyncConnection.connect(database_url) as holder:
        await holder.execute("LOCK TABLE webhook_endpoints IN ACCESS EXCLUSIVE MODE")
        code, out = await run_command(
            "endpoints", "list", env=command_env(DATABASE_URL=database_url)
        )
        await holder.rollback()
    assert code == 1, out
    assert "cannot reach" not in out, out
    assert "cancelled a statement of this command" in out and setting in out, out


async def test_run_warns_when_a_role_has_session_replication_role_replica(
    database_url: str, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """session_replication_role = replica for a producers' role fires no trigger, the
    wake-up's neither (like fluxora.notify = off, which was said): idle dispatchers find
    those events only at their poll."""
    role = f"fluxora_repl_{prefix.strip(':').replace('-', '_')[-12:]}".lower()
    name = sql.Identifier(role)
    with psycopg.connect(database_url, autocommit=True) as conn:
        database = sql.Identifier(str(conn.info.dbname))
        conn.execute(sql.SQL("CREATE ROLE {}").format(name))
        conn.execute(
            sql.SQL("ALTER ROLE {} IN DATABASE {} SET session_replication_role = replica").format(
                name, database
            )
        )
    caplog.set_level(logging.WARNING, logger="fluxora_webhooks.service")
    try:
        async with await open_session(database_url, autocommit=True) as conn:
            assert await warn_if_wake_up_off(conn, 10_000) is True
        assert "session_replication_role is replica" in caplog.text
        assert "WEBHOOK_POLL_INTERVAL_MS" in caplog.text
    finally:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(sql.SQL("ALTER ROLE {} IN DATABASE {} RESET ALL").format(name, database))
            conn.execute(sql.SQL("DROP ROLE {}").format(name))
