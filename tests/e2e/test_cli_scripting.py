"""The command as a script drives it: standard output read by another program (a pipe its
reader closes early, ``--json``), no terminal on standard input, errors said the same way
by every command."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys

import pytest

from tests.support.procs import command_env

pytestmark = pytest.mark.e2e


def _command(
    *args: str, env: dict[str, str], **options: object
) -> subprocess.CompletedProcess[str]:
    done: subprocess.CompletedProcess[str] = subprocess.run(
        [sys.executable, "-m", "fluxora_webhooks", *args],
        env=env,
        text=True,
        timeout=60,
        **options,  # type: ignore[call-overload]
    )
    return done


def _env(database_url: str, **extra: str) -> dict[str, str]:
    return command_env(DATABASE_URL=database_url, **extra)


def _add_endpoint(env: dict[str, str]) -> str:
    done = _command(
        "endpoints", "add", "--tenant", "acme", "--url", "https://hooks.example.com/x",
        "--json", env=env, capture_output=True, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return str(json.loads(done.stdout)["id"])


@pytest.mark.parametrize(
    "args",
    [("status",), ("status", "--json"), ("endpoints", "list"), ("tokens", "list")],
)
def test_a_reader_that_went_away_ends_a_table_as_it_ends_json_with_exit_0(
    database_url: str, args: tuple[str, ...]
) -> None:
    """``fluxora-webhooks status | head -1`` under ``set -o pipefail``: the reader closed
    its end, what it took was written, nothing to report, exit 0 (rich's tables exited 1)."""
    env = _env(database_url)
    _add_endpoint(env)
    created = _command(
        "tokens", "create", "--name", "ci", "--json",
        env=env, capture_output=True, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert created.returncode == 0, created.stderr
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line is written
    try:
        done = _command(
            *args, env=env, stdout=write, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL
        )
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (0, "")


def test_endpoints_remove_asks_on_the_terminal_not_on_standard_output(database_url: str) -> None:
    """``endpoints remove ID --json > out.json`` at a terminal: the question is asked where
    dlq asks it (stderr), and standard output is the JSON answer alone."""
    env = _env(database_url)
    endpoint_id = _add_endpoint(env)

    # No terminal and no --yes: refused, nothing removed, nothing on stdout.
    refused = _command(
        "endpoints", "remove", endpoint_id, "--json",
        env=env, capture_output=True, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert refused.returncode == 2
    assert refused.stdout == ""
    assert "--yes" in refused.stderr

    main, terminal = pty.openpty()
    try:
        os.write(main, b"y\n")  # typed ahead: the terminal keeps it until it is read
        done = _command(
            "endpoints", "remove", endpoint_id, "--json",
            env=env, stdin=terminal, stderr=terminal, stdout=subprocess.PIPE,
        )  # fmt: skip
        os.set_blocking(main, False)
        try:
            asked = os.read(main, 65536).decode(errors="replace")
        except BlockingIOError:
            asked = ""
    finally:
        os.close(terminal)
        os.close(main)
    assert done.returncode == 0, (done.stdout, asked)
    assert json.loads(done.stdout) == {"id": endpoint_id, "removed": True, "dead_lettered": 0}
    assert "[y/N]" in asked
    shown = _command(
        "endpoints", "show", endpoint_id, "--json",
        env=env, capture_output=True, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert shown.returncode == 1


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_a_missing_dead_letter_is_said_as_a_missing_endpoint_is(
    database_url: str, log_format: str
) -> None:
    """``dlq show ID --json`` takes ``--json`` as every other show does (it prints JSON
    anyway), and an id that names nothing exits 1 with the message every command gives:
    ``fluxora-webhooks: no ...``, or a log record with ``LOG_FORMAT=json``."""
    env = _env(database_url, LOG_FORMAT=log_format)
    missing = "00000000-0000-0000-0000-000000000000"
    answers = [
        _command(*args, env=env, capture_output=True, stdin=subprocess.DEVNULL)
        for args in (
            ("dlq", "show", missing, "--json"),
            ("dlq", "show", missing),
            ("endpoints", "show", "ep_nope", "--json"),
        )
    ]
    for done in answers:
        assert (done.returncode, done.stdout) == (1, ""), done.stderr
        if log_format == "json":
            record = json.loads(done.stderr)
            assert record["level"] == "critical"
            assert record["message"].startswith("no ")
        else:
            assert done.stderr.startswith("fluxora-webhooks: no ")
    assert missing in answers[0].stderr


def test_migrate_says_what_it_did_as_json(empty_database_url: str) -> None:
    env = _env(empty_database_url)
    first = _command("migrate", "--json", env=env, capture_output=True)
    assert first.returncode == 0, first.stderr
    done = json.loads(first.stdout)
    assert done["applied"][0] == {"version": 1, "name": "outbox"}
    assert done["applied"][-1]["version"] == done["version"]
    assert (done["partitioned"], done["converted"]) == (None, False)
    again = _command("migrate", "--json", "--partitioned", env=env, capture_output=True)
    assert again.returncode == 0, again.stderr
    done = json.loads(again.stdout)
    assert done["applied"] == [] and done["partitioned"] is True and done["converted"] is True
    assert done["partition_interval"] == "1d" and done["partition_interval_kept"] is False
