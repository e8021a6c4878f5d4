"""Secrets read from files (``DATABASE_URL_FILE``, ``WEBHOOK_SECRET_FILE``, ...), as
container platforms mount them: a supervised ``run`` delivers with them, and a file that is
wrong stops start-up naming the variable and the path, never what the file holds."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from fluxora_webhooks.signing import verify_request
from tests.support.dispatch import delivered, enqueue_many, wait_until
from tests.support.procs import command_env, run_command, start_dispatcher
from tests.support.receiver import Receiver

pytestmark = pytest.mark.e2e

FILE_SECRET = "a-secret-mounted-as-a-file-0123456789"


def _file(tmp_path: Path, name: str, content: str | bytes) -> str:
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    path.chmod(0o600)
    return str(path)


async def test_a_supervised_run_reads_its_engines_and_secret_from_files(
    database_url: str, redis_url: str, redis_prefix: str, receiver: Receiver, tmp_path: Path
) -> None:
    env = command_env(
        # A line break at the end, as `echo ... > file` and editors leave it.
        DATABASE_URL_FILE=_file(tmp_path, "db", database_url + "\n"),
        REDIS_URL_FILE=_file(tmp_path, "redis", redis_url + "\r\n"),
        WEBHOOK_SECRET_FILE=_file(tmp_path, "secret", FILE_SECRET + "\n"),
        WEBHOOK_URL=receiver.url,
        WEBHOOK_WORKERS="2",
        WEBHOOK_METRICS_PORT="0",
        WEBHOOK_POLL_INTERVAL_MS="200",
        FLUXORA_REDIS_PREFIX=redis_prefix,
    )
    run = await start_dispatcher(env, tmp_path / "run.log")
    try:
        await enqueue_many(database_url, 40)

        async def all_delivered() -> bool:
            return await delivered(database_url) == 40

        await wait_until(all_delivered, timeout=60, what="40 deliveries")
        # The workers got the values `run` read, not the paths: a worker started later
        # signs as the others do, whatever the file holds by then.
        workers = psutil.Process(run.pid).children()
        assert len(workers) == 2, run.log()
        for worker in workers:
            seen = worker.environ()
            assert not any(name.endswith("_URL_FILE") for name in seen), sorted(seen)
            assert "WEBHOOK_SECRET_FILE" not in seen
    finally:
        run.terminate()
        assert await run.wait(30) == 0, run.log()
    assert len(receiver.received) >= 40
    for item in receiver.received:
        verify_request(item.body, item.headers, FILE_SECRET)  # raises if signed otherwise


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("both", "WEBHOOK_SECRET_FILE: and WEBHOOK_SECRET are both set: keep one"),
        ("missing", "WEBHOOK_SECRET_FILE: {tmp}/nowhere: cannot be read (No such file"),
        ("directory", "WEBHOOK_SECRET_FILE: {tmp}: cannot be read (Is a directory)"),
        ("empty", "WEBHOOK_SECRET_FILE: {tmp}/secret: the file is empty"),
        ("huge", "WEBHOOK_SECRET_FILE: {tmp}/secret: longer than 65536 bytes"),
        (
            "bad-key",
            "WEBHOOK_SECRET: starts with whsec_ but the rest is not valid base64"
            " (Standard Webhooks) (read from WEBHOOK_SECRET_FILE)",
        ),
        (
            "bad-url",
            "DATABASE_URL: must be a postgresql:// URL or a libpq connection string"
            " (read from DATABASE_URL_FILE)",
        ),
    ],
)
async def test_a_wrong_secret_file_stops_start_up_naming_it_and_not_its_content(
    case: str, expected: str, database_url: str, receiver: Receiver, tmp_path: Path
) -> None:
    content = {"empty": "\n", "huge": "x" * 70_000, "bad-key": "whsec_!tiny-secret-7f3a\n"}.get(
        case, FILE_SECRET
    )
    env = command_env(
        DATABASE_URL=database_url,
        REDIS_URL="redis://127.0.0.1:1/0",  # never reached: start-up stops before
        WEBHOOK_URL=receiver.url,
        WEBHOOK_SECRET_FILE=_file(tmp_path, "secret", content),
        WEBHOOK_METRICS_PORT="0",
        WEBHOOK_WORKERS="1",
    )
    if case == "both":
        env["WEBHOOK_SECRET"] = FILE_SECRET
    elif case == "missing":
        env["WEBHOOK_SECRET_FILE"] = str(tmp_path / "nowhere")
    elif case == "directory":
        env["WEBHOOK_SECRET_FILE"] = str(tmp_path)
    elif case == "bad-url":
        del env["DATABASE_URL"]
        env["DATABASE_URL_FILE"] = _file(tmp_path, "db", "mysql://root:pw-7f3a@db/app\n")
    code, out = await run_command("run", env=env, timeout=30)
    assert code == 2, out
    assert "configuration error: " + expected.format(tmp=tmp_path) in out, out
    assert "Traceback" not in out
    for secret in (FILE_SECRET, "tiny-secret-7f3a", "pw-7f3a", "x" * 100):
        assert secret not in out
