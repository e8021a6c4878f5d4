"""For the consumer's inbox tests: signed requests made by the dispatcher's own Signer, and
the consumer process of ``tests/support/inbox_consumer.py``."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fluxora_webhooks.signing import Signer
from tests.support.dispatch import SECRET


@dataclass(frozen=True)
class Delivery:
    """One attempt of one event, as the dispatcher would send it."""

    delivery_id: str
    body: bytes
    headers: dict[str, str]

    def payload(self) -> Any:
        return json.loads(self.body)

    def standard_only(self) -> dict[str, str]:
        return {k: v for k, v in self.headers.items() if not k.startswith("x-fluxora-")}

    def fluxora_only(self) -> dict[str, str]:
        return {k: v for k, v in self.headers.items() if not k.startswith("webhook-")}

    def raw_pairs(self) -> list[tuple[bytes, bytes]]:
        """The headers as an ASGI scope carries them."""
        return [(k.encode(), v.encode()) for k, v in self.headers.items()]


def delivery(
    payload: Any = None,
    *,
    delivery_id: str | None = None,
    secret: bytes = SECRET,
    previous: bytes | None = None,
    timestamp: int | None = None,
    attempt: int = 1,
    event_type: str = "account.credited",
    body: bytes | None = None,
) -> Delivery:
    delivery_id = delivery_id or str(uuid.uuid4())
    if body is None:
        body = json.dumps({"amount": 1} if payload is None else payload).encode()
    headers = Signer(secret, previous).headers(
        delivery_id=delivery_id,
        event_type=event_type,
        attempt=attempt,
        body=body,
        timestamp=int(time.time()) if timestamp is None else timestamp,
    )
    return Delivery(delivery_id, body, headers)


@dataclass
class ConsumerProcess:
    """``python -m tests.support.inbox_consumer`` on a port (shared by its replicas),
    restartable after a kill; its output accumulates in ``log_path``.

    A warm spare (imported, not yet listening) waits for each restart, so that a restart
    costs the time to bind and connect, not Python's start-up."""

    port: int
    env: dict[str, str]
    log_path: Path
    proc: asyncio.subprocess.Process | None = None
    spare: asyncio.subprocess.Process | None = None
    starts: int = 0
    spawned: int = 0
    keep_spare: bool = True

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    async def _spawn(self) -> asyncio.subprocess.Process:
        self.spawned += 1
        seed = f"{self.env.get('CONSUMER_SEED', '0')}-{self.spawned}"
        with self.log_path.open("ab") as log:
            return await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "tests.support.inbox_consumer",
                "--port",
                str(self.port),
                env={**self.env, "CONSUMER_SEED": seed, "CONSUMER_WAIT_FOR_GO": "1"},
                stdin=asyncio.subprocess.PIPE,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
            )

    async def start(self) -> None:
        """Start the next process (the spare, when there is one) and wait until it listens."""
        proc, self.spare = self.spare or await self._spawn(), None
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
        await proc.stdin.drain()
        self.proc = proc
        self.starts += 1
        await self.wait_ready()
        if self.keep_spare:
            self.spare = await self._spawn()

    async def wait_ready(self, timeout: float = 30) -> None:
        """Until this process prints its ``ready`` line (a replica on the same port may
        already be answering)."""
        deadline = time.monotonic() + timeout
        while self.log().count("ready\n") < self.starts:
            assert self.proc is not None and self.proc.returncode is None, self.log()
            assert time.monotonic() < deadline, "the consumer did not start"
            await asyncio.sleep(0.02)

    def exited(self) -> bool:
        return self.proc is None or self.proc.returncode is not None

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)
        if self.proc is not None:
            await asyncio.wait_for(self.proc.wait(), 10)

    async def stop(self) -> None:
        if self.spare is not None and self.spare.returncode is None:
            self.spare.send_signal(signal.SIGKILL)  # never listened: nothing to drain
            await asyncio.wait_for(self.spare.wait(), 10)
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                await self.kill()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def self_kills(self, when: str) -> list[str]:
        """Delivery ids announced before a self-kill (``before-commit`` / ``after-commit``)."""
        prefix = f"kill {when} "
        return [line[len(prefix) :] for line in self.log().splitlines() if line.startswith(prefix)]
