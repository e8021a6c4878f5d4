"""Dispatcher processes for end-to-end tests: the real command, real signals."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.dispatch import SECRET

STRIP = ("DATABASE_URL", "REDIS_URL", "WEBHOOK_", "LOG_FORMAT", "FLUXORA_", "OTEL_")


def free_port() -> int:
    """A TCP port on 127.0.0.1 free a moment ago (for a server a test starts)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def command_env(**overrides: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(STRIP)}
    env.update(overrides)
    return env


def dispatcher_env(
    database_url: str, redis_url: str, webhook_url: str, prefix: str, **extra: str
) -> dict[str, str]:
    settings = {
        "DATABASE_URL": database_url,
        "REDIS_URL": redis_url,
        "WEBHOOK_URL": webhook_url,
        "WEBHOOK_SECRET": SECRET.decode(),
        "WEBHOOK_METRICS_PORT": "0",
        "WEBHOOK_POLL_INTERVAL_MS": "500",
        "FLUXORA_REDIS_PREFIX": prefix,
        # One process, no supervisor: "the dispatcher" is the process a test kills.
        "WEBHOOK_WORKERS": "1",
    }
    return command_env(**{**settings, **extra})


@dataclass
class DispatcherProcess:
    proc: asyncio.subprocess.Process
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)

    async def wait(self, timeout: float) -> int:
        return await asyncio.wait_for(self.proc.wait(), timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


async def start_dispatcher(
    env: dict[str, str], log_path: Path, *, module: str = "fluxora_webhooks"
) -> DispatcherProcess:
    """``python -m fluxora_webhooks run`` (or ``python -m <module> run``)."""
    log_file = log_path.open("wb")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        module,
        "run",
        env=env,
        stdout=log_file,
        stderr=asyncio.subprocess.STDOUT,
    )
    log_file.close()
    return DispatcherProcess(proc, log_path)


async def run_command(*args: str, env: dict[str, str], timeout: float = 60) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "fluxora_webhooks",
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        # A command that should have stopped (a test failing) is not left running.
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace")


async def run_json(*args: str, env: dict[str, str]) -> tuple[int, Any]:
    """:func:`run_command`, its output read as JSON when it is (a ``--json`` command's),
    else as text (an error)."""
    code, out = await run_command(*args, env=env)
    try:
        return code, json.loads(out)
    except json.JSONDecodeError:
        return code, out


@contextlib.asynccontextmanager
async def dispatchers(
    count: int, env: dict[str, str], tmp_path: Path
) -> AsyncIterator[list[DispatcherProcess]]:
    procs = [await start_dispatcher(env, tmp_path / f"dispatcher-{i}.log") for i in range(count)]
    try:
        yield procs
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                await p.wait(30)
            except TimeoutError:
                p.kill()
                await p.wait(10)


def run_benchmark(argv: list[str], results: Path, timeout: float = 120) -> str:
    """Run a benchmark command (``fluxora-webhooks bench`` or a script under benchmarks/)
    on this suite's engines, writing its results into ``results``; its output. Fails the
    test with that output when it exits non-zero."""
    import subprocess

    from tests.support import engines

    proc = subprocess.run(
        [
            sys.executable,
            *argv,
            "--results",
            str(results),
            "--database-url",
            engines.admin_database_url(),
            "--redis-url",
            engines.redis_url(),
        ],
        env=command_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=timeout,
        check=False,
    )
    text = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, text
    return text
