"""``fluxora-webhooks inbox install | prune`` as a consumer's operator runs them."""

from __future__ import annotations

import json

import psycopg
import pytest

from tests.support.procs import command_env, run_command

pytestmark = pytest.mark.e2e


async def test_install_then_prune(empty_database_url: str) -> None:
    env = command_env(DATABASE_URL=empty_database_url)
    code, out = await run_command("inbox", "install", env=env)
    assert (code, out.strip()) == (0, "created webhook_inbox"), out
    code, out = await run_command("inbox", "install", "--json", env=env)
    assert code == 0 and json.loads(out) == {"created": False, "added_columns": []}, out

    code, out = await run_command("inbox", "prune", "--older-than", "30d", env=env)
    assert code == 0 and "deleted 0 delivery id(s)" in out, out  # an empty inbox is fine
    async with await psycopg.AsyncConnection.connect(empty_database_url, autocommit=True) as c:
        await c.execute(
            "INSERT INTO webhook_inbox (delivery_id, received_at)"
            " SELECT 'old-' || g, now() - interval '31 days' FROM generate_series(1, 7) g"
            " UNION ALL SELECT 'new-' || g, now() - interval '1 day' FROM generate_series(1, 3) g"
        )
    code, out = await run_command(
        "inbox", "prune", "--older-than", "30d", "--dry-run", "--json", env=env
    )
    assert code == 0 and json.loads(out)["deleted"] == 7 and json.loads(out)["dry_run"], out
    code, out = await run_command(
        "inbox", "prune", "--older-than", "30d", "--batch-size", "3", "--json", env=env
    )
    result = json.loads(out)
    assert code == 0 and (result["deleted"], result["batches"]) == (7, 3), out
    for zero in ("0d", "0s"):  # a slip, not "forget every id", even with --force
        code, out = await run_command("inbox", "prune", "--older-than", zero, "--force", env=env)
        assert code == 2 and "--older-than: must be more than 0" in out, out
    code, out = await run_command("inbox", "prune", "--older-than", "12h", "--force", env=env)
    assert code == 0 and "deleted 3 delivery id(s)" in out, out


@pytest.mark.parametrize(
    ("columns", "code", "said"),
    [
        # Every delivery would fail on it: not "already installed"; exit 3 naming the fix.
        ("delivery_id text, attempt integer", 3, "ADD PRIMARY KEY (delivery_id)"),
        # A delivery_id that cannot hold every id receive stores: refused, naming its type.
        (
            "delivery_id int PRIMARY KEY, event_type text, attempt int, received_at timestamptz",
            3,
            "webhook_inbox.delivery_id is integer, not text",
        ),
        ("delivery_id varchar(36) PRIMARY KEY", 3, "is character varying(36), not text"),
        # Completed (consumers.md), and said so: the operator learns the table changed.
        (
            "delivery_id text PRIMARY KEY, attempt int",
            0,
            "added its missing column(s): event_type, received_at",
        ),
    ],
)
async def test_install_on_a_hand_made_table_says_what_it_did_or_what_to_do(
    empty_database_url: str, columns: str, code: int, said: str
) -> None:
    async with await psycopg.AsyncConnection.connect(empty_database_url, autocommit=True) as c:
        await c.execute(f"CREATE TABLE webhook_inbox ({columns})")
    env = command_env(DATABASE_URL=empty_database_url)
    got, out = await run_command("inbox", "install", env=env)
    assert got == code and said in out, out
    assert "already installed" not in out and "Traceback" not in out
    if code == 0:  # now complete: nothing more to add
        got, out = await run_command("inbox", "install", "--json", env=env)
        assert got == 0 and json.loads(out) == {"created": False, "added_columns": []}, out


async def test_prune_before_install_says_what_to_run(empty_database_url: str) -> None:
    env = command_env(DATABASE_URL=empty_database_url)
    code, out = await run_command("inbox", "prune", "--older-than", "30d", env=env)
    assert code != 0 and "fluxora-webhooks inbox install" in out, out
    assert "Traceback" not in out


async def test_unreachable_database_is_one_line_and_exit_1() -> None:
    env = command_env(DATABASE_URL="postgresql://someone:pw-not-shown@127.0.0.1:1/nowhere")
    for args in (("install",), ("prune", "--older-than", "30d")):
        code, out = await run_command("inbox", *args, env=env)
        assert code == 1, (args, out)
        assert out.strip().count("\n") == 0 and "cannot reach the database" in out, out
        assert "Traceback" not in out and "pw-not-shown" not in out
