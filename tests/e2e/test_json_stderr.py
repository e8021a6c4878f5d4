"""LOG_FORMAT=json: every line the long-running commands write to stderr is a JSON record,
also the lines that stop them before they run (a usage error in the command line of a
deployment, a worker started by hand) and an uncaught exception, so a log pipeline that
parses JSON never meets a line of text."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import pytest

from tests.support.procs import command_env, run_command

pytestmark = pytest.mark.e2e


def _records(out: str) -> list[dict[str, Any]]:
    """Every line of the output as a JSON record (a line that is not one fails the test)."""
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines, "no output"
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise AssertionError(f"not a JSON line: {line!r}\n{out}") from None
        assert isinstance(record, dict), line
        assert {"ts", "level", "logger", "message", "pid"} <= record.keys(), line
        records.append(record)
    return records


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("run", "--workers", "2"), "error: unrecognized arguments: --workers 2"),
        (("api", "--port", "8080"), "error: unrecognized arguments: --port 8080"),
        (("rnu",), "error: argument COMMAND: invalid choice: 'rnu'"),
    ],
)
async def test_a_usage_error_is_a_json_record(args: tuple[str, ...], said: str) -> None:
    env = command_env(LOG_FORMAT="json", DATABASE_URL="postgresql://127.0.0.1:1/none")
    code, out = await run_command(*args, env=env, timeout=30)
    assert code == 2, out
    (record,) = _records(out)
    assert record["level"] == "critical" and record["logger"] == "fluxora_webhooks.cli", record
    assert record["message"].startswith(said), record
    assert "--help" in record["message"], record


async def test_a_worker_started_by_hand_says_why_it_stops_as_a_json_record() -> None:
    env = command_env(LOG_FORMAT="json")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fluxora_webhooks.worker",
        "--index", "0", "--ready-fd", "1", "--supervisor", "1",
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2, out
    (record,) = _records(out.decode())
    assert record["level"] == "critical", record
    assert record["message"] == "started by `fluxora-webhooks run` only", record


async def test_an_uncaught_exception_is_a_json_record_with_its_traceback() -> None:
    """What the command does not translate into a message (a defect) still ends as records:
    one for the main thread, one for another thread, the traceback in ``exception``."""
    script = (
        "import threading\n"
        "from fluxora_webhooks import logs\n"
        "logs.configure('json')\n"
        "def fail():\n"
        "    raise ValueError('in a thread')\n"
        "t = threading.Thread(target=fail, name='helper'); t.start(); t.join()\n"
        "raise RuntimeError('unexpected')\n"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, env=command_env(),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 1, out
    thread, main = _records(out.decode())
    assert thread["message"] == "unexpected error in thread helper: ValueError", thread
    assert "ValueError: in a thread" in thread["exception"], thread
    assert main["level"] == "critical" and main["message"] == "unexpected error: RuntimeError"
    assert "Traceback (most recent call last)" in main["exception"], main
    assert "RuntimeError: unexpected" in main["exception"], main
