"""A Redis Cluster of the test's own: three masters on loopback, no replicas.

Built from the ``redis-server`` binary and redis-py only (slots assigned with CLUSTER
ADDSLOTS, nodes joined with CLUSTER MEET), so no ``redis-cli`` is needed. Each node's
cluster bus listens on its port + 10000, so ports are chosen below 55536 and both must be
free. The caller stops it (``stop``), also after a failure.
"""

from __future__ import annotations

import random
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

from tests.support.redis_server import answers_as, redis_binary

SLOTS = 16384
BUS_OFFSET = 10000


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_ports(count: int) -> list[int]:
    """``count`` ports whose cluster bus port (port + 10000) is free too."""
    chosen: list[int] = []
    while len(chosen) < count:
        port = random.randrange(20000, 45000)
        if port not in chosen and _bindable(port) and _bindable(port + BUS_OFFSET):
            chosen.append(port)
    return chosen


class RedisCluster:
    """Three cluster-enabled redis-server processes joined into one cluster."""

    def __init__(self, directory: Path, masters: int = 3) -> None:
        self.directory = directory
        self.ports = cluster_ports(masters)
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def url(self, port: int | None = None) -> str:
        return f"redis://127.0.0.1:{port or self.ports[0]}/0"

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=2)

    def start(self) -> None:
        # A port found free may be taken before the node binds it (another test's server, a
        # client connection's ephemeral port, which shares this range): the node then exits,
        # or another process answers there. Such a node is started again on other ports.
        for _ in range(5):
            if self._spawn():
                break
            self.stop()
            self.procs.clear()
            self.ports = cluster_ports(len(self.ports))
        else:
            raise AssertionError("could not start the cluster's nodes on free ports")
        share = SLOTS // len(self.ports)
        for i, port in enumerate(self.ports):
            last = SLOTS - 1 if i == len(self.ports) - 1 else (i + 1) * share - 1
            self.client(port).execute_command("CLUSTER ADDSLOTS", *range(i * share, last + 1))
        first = self.client(self.ports[0])
        for port in self.ports[1:]:
            first.execute_command("CLUSTER MEET", "127.0.0.1", port)
        self._wait(self._formed, "the cluster to form", timeout=30)

    def _spawn(self) -> bool:
        """Start a node on each port; False unless each port is answered by its own node."""
        for port in self.ports:
            self.procs[port] = subprocess.Popen(
                [redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--daemonize", "no", "--dir", str(self.directory),
                 "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                 "--cluster-node-timeout", "1000"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )  # fmt: skip
        return all(answers_as(port, proc) for port, proc in self.procs.items())

    def _formed(self) -> bool:
        for port in self.ports:
            info = self.client(port).cluster("INFO")
            if info.get("cluster_state") != "ok" or int(info["cluster_known_nodes"]) != len(
                self.ports
            ):
                return False
        return True

    @staticmethod
    def _wait(check: object, what: str, timeout: float = 10) -> None:
        assert callable(check)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if check():
                    return
            except (redis.ConnectionError, redis.ResponseError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.05)

    def owner(self, key: str) -> int:
        """The port of the master that serves ``key``'s hash slot."""
        client = self.client(self.ports[0])
        slot = int(client.execute_command("CLUSTER KEYSLOT", key))
        for start, end, master, *_ in client.execute_command("CLUSTER SLOTS"):
            if int(start) <= slot <= int(end):
                return int(master[1])
        raise AssertionError(f"no node serves slot {slot}")

    def node_id(self, port: int) -> str:
        return str(self.client(port).execute_command("CLUSTER MYID").decode())

    def stop_node(self, port: int) -> None:
        proc = self.procs.get(port)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
            proc.wait(10)

    def stop(self) -> None:
        for port in self.ports:
            self.stop_node(port)
