"""Issue 18, the outside QA pass, as an operator meets it: the command run as a process,
its exit code and output; a pseudo-terminal where the command asks."""

from __future__ import annotations

import asyncio
import os
import pty
import select
import subprocess
import sys
import time

import psycopg
import pytest

from tests.support.procs import command_env, dispatcher_env

pytestmark = pytest.mark.e2e

COMMANDS = (
    ("run",),
    ("migrate",),
    ("dlq", "list"),
    ("status",),
    ("prune", "--older-than", "7d"),
    ("inbox", "install"),
)


async def _run(*args: str, env: dict[str, str], timeout: float = 60) -> tuple[int, str]:
    """The command with no terminal at all (stdin is /dev/null)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fluxora_webhooks", *args, env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace")


@pytest.mark.parametrize(
    "url", ["postgresql://u:pw-secret@h:notaport/db", "postgresql://h/db?nonsense=1"]
)
async def test_a_garbage_database_url_exits_2_for_every_command(url: str) -> None:
    env = dispatcher_env(url, "redis://127.0.0.1:1/0", "https://hooks.example.com/x", "p:")
    results = await asyncio.gather(*(_run(*args, env=env) for args in COMMANDS))
    for args, (code, out) in zip(COMMANDS, results, strict=True):
        assert code == 2, (args, out)
        assert "configuration error: DATABASE_URL:" in out, (args, out)
        assert "Traceback" not in out and "pw-secret" not in out, (args, out)


async def test_a_number_of_thousands_of_digits_stops_start_up_naming_it() -> None:
    env = dispatcher_env(
        "postgresql://127.0.0.1:1/x", "redis://127.0.0.1:1/0", "https://h.example/x", "p:"
    )
    env["WEBHOOK_BATCH_SIZE"] = "9" * 5000
    code, out = await _run("run", env=env)
    assert code == 2 and "configuration error: WEBHOOK_BATCH_SIZE: must be at most" in out, out
    assert "Traceback" not in out and len(out) < 500


async def _dead_letters(database_url: str, rows: list[tuple[str, str, str]]) -> list[str]:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        ids = []
        for event_type, stream_id, error in rows:
            cur = await conn.execute(
                "INSERT INTO webhook_dead_letter (delivery_id, stream_id, event_type, payload,"
                " attempts, reason, last_status, last_error, enqueued_at, dead_at)"
                " VALUES (gen_random_uuid(), %s, %s, '{}', 8, '[/]', 503, %s, now(), now())"
                " RETURNING delivery_id::text",
                (stream_id, event_type, error),
            )
            row = await cur.fetchone()
            assert row is not None
            ids.append(str(row[0]))
    return ids


async def test_dlq_list_shows_hostile_stored_text_as_data(database_url: str) -> None:
    ids = await _dead_letters(
        database_url,
        [
            ("[bold]stream.updated[/bold]", "[link=https://evil.example/]x[/link]", "e"),
            ("\x1b]8;;https://evil.example/\x1b\\", "\x1b[2J\x1b[31mred", "\x9b\u202e"),
        ],
    )
    env = command_env(DATABASE_URL=database_url)
    code, out = await _run("dlq", "list", env=env)
    assert code == 0, out
    assert "[bold]stream.updated[/bold]" in out and "[link=https://evil.example/]x[/link]" in out
    assert "\\x1b]8;;https://evil.example/\\x1b\\" in out and "\\x1b[2J\\x1b[31mred" in out
    assert "\x1b" not in out and "\x9b" not in out and "\u202e" not in out
    assert all(i in out for i in ids)
    code, out = await _run("dlq", "show", ids[1], env=env)
    assert code == 0 and "\x1b" not in out and "\\u001b[2J" in out, out


def _on_a_terminal(
    args: tuple[str, ...], env: dict[str, str], answer: bytes
) -> tuple[int, str, str]:
    """The command with its stdin and stderr on a pseudo-terminal, answering the prompt.
    Returns (exit code, stdout, what the terminal showed)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fluxora_webhooks", *args],
        env=env, stdin=slave, stderr=slave, stdout=subprocess.PIPE,
    )  # fmt: skip
    os.close(slave)
    shown = b""
    deadline = time.monotonic() + 60
    try:
        while b"[y/N]" not in shown and time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    shown += os.read(master, 4096)
                except OSError:  # the command exited without asking
                    break
        if b"[y/N]" in shown:
            os.write(master, answer + b"\n")
        out, _ = proc.communicate(timeout=60)
        while select.select([master], [], [], 0.2)[0]:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                break
            if not chunk:
                break
            shown += chunk
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out.decode(errors="replace"), shown.decode(errors="replace")


async def _waiting(database_url: str) -> int:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        cur = await conn.execute("SELECT count(*) FROM webhook_dead_letter WHERE state = 'dead'")
        row = await cur.fetchone()
        assert row is not None
        return int(row[0])


async def test_purge_all_asks_on_a_terminal_and_needs_yes_otherwise(database_url: str) -> None:
    ids = await _dead_letters(database_url, [("e", f"s{i}", "x") for i in range(4)])
    env = command_env(DATABASE_URL=database_url)

    code, out = await _run("dlq", "purge", "--all", env=env)
    assert code == 2 and "error: --yes: is needed to go ahead without a terminal" in out, out
    assert await _waiting(database_url) == 4

    code, out, shown = await asyncio.to_thread(_on_a_terminal, ("dlq", "purge", "--all"), env, b"n")
    assert "discards every waiting dead letter" in shown and "[y/N]" in shown, shown
    assert code == 1 and await _waiting(database_url) == 4, (out, shown)

    code, out = await _run("dlq", "purge", ids[0], env=env)  # explicit ids: no question
    assert code == 0 and f"purged {ids[0]}" in out, out
    assert await _waiting(database_url) == 3

    code, out, shown = await asyncio.to_thread(_on_a_terminal, ("dlq", "purge", "--all"), env, b"y")
    assert code == 0 and "3 dead letter(s) purged" in out, (out, shown)
    assert await _waiting(database_url) == 0

    await _dead_letters(database_url, [("e", "s", "x")])
    code, out = await _run("dlq", "replay", "--all", "--yes", env=env)
    assert code == 0 and "1 dead letter(s) replayed" in out, out
