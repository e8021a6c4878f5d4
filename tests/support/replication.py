"""A PostgreSQL primary and a synchronous standby of the test's own, for failover tests.

Both are :class:`~tests.support.chaos.OwnPostgres` servers (temporary folders, free
loopback ports, run as ``postgres`` when the tests run as root) with
``synchronous_commit = on``. Once the standby streams, :func:`make_synchronous` sets
``synchronous_standby_names = '*'`` on the primary, so a commit is acknowledged only once the
standby has flushed it. It is set after the base backup, so the standby's copy of the
configuration does not carry it: once promoted, it must not wait for a standby of its own.
"""

from __future__ import annotations

import time

import psycopg

from tests.support.chaos import OwnPostgres


class ReplicatedPostgres(OwnPostgres):
    def start(self) -> None:
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.folder} -c fsync=off "
            "-c max_connections=100 -c wal_level=replica -c max_wal_senders=5 "
            "-c synchronous_commit=on"
        )
        self._run("pg_ctl", "start", "-D", str(self.data), "-l", str(self.log_path), "-w",
                  "-t", "60", "-o", options)  # fmt: skip

    def clone_from(self, primary: OwnPostgres) -> None:
        """A base backup of ``primary`` that starts as its streaming standby (``-R``)."""
        self._run("pg_basebackup", "-h", "127.0.0.1", "-p", str(primary.port), "-U",
                  "postgres", "-D", str(self.data), "-R", "-X", "stream", "-c", "fast")  # fmt: skip

    def promote(self) -> None:
        self._run("pg_ctl", "promote", "-D", str(self.data), "-w", "-t", "60")


def make_synchronous(primary: OwnPostgres, timeout: float = 30) -> None:
    """Make the primary's commits wait for its standby; returns once the standby is in
    synchronous state."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(primary.url(), autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
        conn.execute("SELECT pg_reload_conf()")
        while True:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'"
            ).fetchone()
            if row and row[0]:
                return
            if time.monotonic() > deadline:
                raise AssertionError("the standby never became synchronous")
            time.sleep(0.05)
