"""Run as container platforms run it (Kubernetes, ECS, Nomad): a read-only file system with
nothing writable but what the pod gives (an emptyDir), no HOME, the configuration from the
environment only, the process as PID 1 of its own PID namespace, stopped with SIGTERM.

Each process runs in a mount namespace of its own (``unshare``) whose root, /tmp, /var/tmp
and /dev/shm are remounted read-only: root cannot write there either (EROFS). Skipped where
namespaces cannot be made (not root, a sandbox without them)."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from tests.support.chaos import tracebacks
from tests.support.dispatch import wait_until
from tests.support.procs import free_port
from tests.support.scrape import get_json

pytestmark = [pytest.mark.e2e]

# The folder a pod would mount writable (an emptyDir): a tmpfs of the namespace's own.
WRITABLE = "/mnt"


def _namespaces_work() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-m", "-p", "-f", "--mount-proc", "sh", "-c", "mount -o remount,bind,ro / "],
        capture_output=True,
        timeout=10,
    )
    return probe.returncode == 0


requires_namespaces = pytest.mark.skipif(
    not _namespaces_work(), reason="needs root and mount/PID namespaces (unshare)"
)


def _container_env(**variables: str) -> dict[str, str]:
    """Only what a pod spec would set (no HOME, no TMPDIR unless given), plus the PATH and
    the PYTHONPATH the test runs with (the source under test)."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **variables}
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return env


def _argv(
    command: list[str], env: dict[str, str], *, pid1: bool, writable: bool, prepare: str = ""
) -> list[str]:
    setup = [
        "mount --make-rprivate /",
        f"{'mount -t tmpfs tmpfs ' + WRITABLE if writable else 'true'}",
        f"{prepare or 'true'}",
        "mount -o remount,bind,ro /",
        *(
            f"if mountpoint -q {d}; then mount -o remount,bind,ro {d}; fi"
            for d in ("/tmp", "/var/tmp", "/dev/shm")
        ),
        "cd /",
        "exec env -i " + " ".join(shlex.quote(f"{k}={v}") for k, v in env.items()) + " "
        + " ".join(shlex.quote(a) for a in [sys.executable, "-m", "fluxora_webhooks", *command]),
    ]  # fmt: skip
    flags = ["-m", "-p", "-f", "--mount-proc"] if pid1 else ["-m"]
    return ["unshare", *flags, "sh", "-ec", "\n".join(setup)]


async def _run(command: list[str], env: dict[str, str], **how: bool) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *_argv(command, env, pid1=how.get("pid1", False), writable=how.get("writable", False)),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace")


class Container:
    def __init__(self, proc: asyncio.subprocess.Process, log: Path) -> None:
        self.proc, self.log_path = proc, log

    @property
    def pid1(self) -> int:
        """The host's pid of the namespace's PID 1 (unshare's child)."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        return int(children.split()[0])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@asynccontextmanager
async def _container(
    command: list[str], env: dict[str, str], log: Path, prepare: str = ""
) -> AsyncIterator[Container]:
    """The command as PID 1 of its own namespaces, a tmpfs at WRITABLE, its output to log."""
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            *_argv(command, env, pid1=True, writable=True, prepare=prepare),
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
        )
    try:
        yield Container(proc, log)
    finally:
        if proc.returncode is None:
            proc.kill()  # unshare: the namespace's processes die with its PID 1
            await proc.wait()


@requires_namespaces
async def test_workers_need_a_writable_temporary_folder_and_say_so(
    database_url: str, redis_url: str, redis_prefix: str
) -> None:
    """With nothing writable, the supervisor cannot make its metrics folder: it stops with
    a configuration error naming WEBHOOK_WORKERS and what to give it, not Python's "No
    usable temporary directory"."""
    env = _container_env(
        DATABASE_URL=database_url,
        REDIS_URL=redis_url,
        FLUXORA_REDIS_PREFIX=redis_prefix,
        WEBHOOK_WORKERS="2",
        WEBHOOK_METRICS_PORT=str(free_port()),
    )
    code, out = await _run(["run"], env)
    assert code == 2, out
    assert "configuration error: WEBHOOK_WORKERS: 2 workers need a writable temporary" in out
    assert "TMPDIR" in out and "WEBHOOK_WORKERS=1" in out, out
    assert tracebacks(out) == 0, out


@requires_namespaces
async def test_a_supervisor_as_pid_1_with_a_tmpdir_runs_drains_and_leaves_nothing(
    database_url: str, redis_url: str, redis_prefix: str, tmp_path: Path
) -> None:
    """PID 1 on a read-only file system, TMPDIR an emptyDir that outlived an earlier
    container (its supervisor, pid 1 too, was killed and left its metrics folder): the
    supervisor removes that folder, is ready with both workers, drains on SIGTERM and exits
    0; with LOG_FORMAT=json every line the workers and it write is one JSON object."""
    port = free_port()
    env = _container_env(
        DATABASE_URL=database_url,
        REDIS_URL=redis_url,
        FLUXORA_REDIS_PREFIX=redis_prefix,
        WEBHOOK_WORKERS="2",
        WEBHOOK_METRICS_PORT=str(port),
        TMPDIR=WRITABLE,
        LOG_FORMAT="json",
    )
    stale = f"{WRITABLE}/fluxora-metrics-1-earlier"
    prepare = f"mkdir {stale} && : > {stale}/counter_7.db"
    async with _container(["run"], env, tmp_path / "run.log", prepare) as box:

        async def both_dispatching() -> bool:
            status, body = await get_json(port, "/readyz")
            return status == 200 and body["workers"] == {"wanted": 2, "dispatching": 2}

        await wait_until(both_dispatching, timeout=60, what="both workers dispatching")
        seen = Path(f"/proc/{box.pid1}/root{WRITABLE}")  # the namespace's view
        names = os.listdir(seen)
        assert len(names) == 1 and names[0].startswith("fluxora-metrics-1-"), names
        assert names[0] != "fluxora-metrics-1-earlier", names
        os.kill(box.pid1, signal.SIGTERM)
        assert await asyncio.wait_for(box.proc.wait(), 40) == 0, box.log()
    lines = box.log().splitlines()
    assert lines and all(json.loads(line) for line in lines), box.log()
    assert tracebacks(box.log()) == 0, box.log()


@requires_namespaces
async def test_an_embedded_engine_that_cannot_write_its_folder_names_the_variable(
    database_url: str,
) -> None:
    """DATABASE_URL given, REDIS_URL forgotten, a read-only working folder: the message says
    that the embedded Redis wanted FLUXORA_HOME and which variables to set."""
    code, out = await _run(["run"], _container_env(DATABASE_URL=database_url))
    assert code == 1, out
    assert "the embedded Redis (REDIS_URL is unset) keeps its files in FLUXORA_HOME" in out
    assert "set REDIS_URL to your own Redis, or FLUXORA_HOME to a writable folder" in out
    assert "embedded PostgreSQL" not in out, out  # DATABASE_URL was given


@requires_namespaces
async def test_the_api_as_pid_1_writes_only_json_lines_and_stops_on_sigterm(
    database_url: str, tmp_path: Path
) -> None:
    """`api` with LOG_FORMAT=json: a container's log collector reads standard output and
    error as one stream, so every line is a JSON record (the "serving on" line of text
    included); SIGTERM stops it with exit 0."""
    port = free_port()
    env = _container_env(
        DATABASE_URL=database_url,
        WEBHOOK_API_HOST="127.0.0.1",
        WEBHOOK_API_PORT=str(port),
        LOG_FORMAT="json",
    )
    async with _container(["api"], env, tmp_path / "api.log") as box:

        async def serving() -> bool:
            return "management API and dashboard on" in box.log()

        await wait_until(serving, timeout=30, what="the API serving")
        os.kill(box.pid1, signal.SIGTERM)
        assert await asyncio.wait_for(box.proc.wait(), 30) == 0, box.log()
    records = [json.loads(line) for line in box.log().splitlines()]
    assert any(r["message"].endswith(f"on http://127.0.0.1:{port}") for r in records), records
    # Third-party loggers write WARNING and above only (docs/operations.md): not uvicorn's
    # "Started server process", "Waiting for application startup" and the like.
    chatter = [r for r in records if r.get("logger", "").startswith("uvicorn")]
    assert not chatter, chatter
