"""A PgBouncer of a test's own in front of the machine's PostgreSQL, in the pool mode asked."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from tests.support.procs import free_port

POSTGRES = ("127.0.0.1", 5432)


def pgbouncer_binary() -> str:
    """Debian's pgbouncer (`make test` installs it)."""
    found = shutil.which("pgbouncer") or (
        "/usr/sbin/pgbouncer" if os.path.exists("/usr/sbin/pgbouncer") else None
    )
    if found is None:
        raise AssertionError("pgbouncer is not installed: run `make pgbouncer` (apt, as root)")
    return found


@contextlib.contextmanager
def pgbouncer(pool_mode: str, pool_size: int = 10) -> Iterator[int]:
    """A pgbouncer in ``pool_mode`` (session, transaction) on a free loopback port, any
    user let in as PostgreSQL's ``postgres``; yields its port, stops it at the end."""
    binary = pgbouncer_binary()
    home = Path(tempfile.mkdtemp(prefix="fluxora-pgbouncer-"))
    home.chmod(0o777)  # it drops to the postgres user when started as root
    port = free_port()
    config = home / "pgbouncer.ini"
    config.write_text(
        "[databases]\n"
        f"* = host={POSTGRES[0]} port={POSTGRES[1]} user=postgres\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        f"auth_type = any\npool_mode = {pool_mode}\n"
        f"max_client_conn = 200\ndefault_pool_size = {pool_size}\n"
        f"logfile = {home / 'pgbouncer.log'}\npidfile = {home / 'pgbouncer.pid'}\n"
    )
    config.chmod(0o644)
    command = [binary, *(["-u", "postgres"] if os.geteuid() == 0 else []), str(config)]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                log = (
                    (home / "pgbouncer.log").read_text()
                    if (home / "pgbouncer.log").exists()
                    else ""
                )
                raise AssertionError(f"pgbouncer did not start: {log[-2000:]}")
            time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(home, ignore_errors=True)


def through(database_url: str, port: int) -> str:
    """``database_url`` (on 127.0.0.1:5432) through the pgbouncer on ``port``."""
    return database_url.replace("@127.0.0.1:5432/", f"@127.0.0.1:{port}/", 1)
