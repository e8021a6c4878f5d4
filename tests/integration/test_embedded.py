"""The embedded PostgreSQL and Redis: start, reuse, sharing between processes, recovery
after crashes, and no stray servers once the last user leaves.

These start real servers in temporary folders (about a second each) and clean up after
themselves, whatever the outcome.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import psycopg
import pytest
import redis.asyncio

from fluxora_webhooks.embedded import (
    EmbeddedEngineError,
    EmbeddedEngines,
    describe,
    embedded_database_url,
    stop_embedded,
)

pytestmark = pytest.mark.integration

# A command using the engines through the plain functions. It reports its URLs and the
# postmaster's start time, then waits for the test to create ``release`` (or to kill it).
USER_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    import psycopg
    from fluxora_webhooks.embedded import embedded_database_url, embedded_redis_url

    home, tag = Path(sys.argv[1]), sys.argv[2]
    go = home.parent / "go"
    while not go.exists():  # start together with the other processes
        time.sleep(0.005)
    database_url = embedded_database_url(home)
    redis_url = embedded_redis_url(home)
    with psycopg.connect(database_url, autocommit=True) as conn:
        # Serialised: CREATE TABLE IF NOT EXISTS alone can still collide in the catalog.
        conn.execute("SELECT pg_advisory_lock(42)")
        conn.execute("CREATE TABLE IF NOT EXISTS marks (tag text)")
        conn.execute("SELECT pg_advisory_unlock(42)")
        conn.execute("INSERT INTO marks VALUES (%s)", (tag,))
        started = conn.execute("SELECT pg_postmaster_start_time()::text").fetchone()[0]
    print(json.dumps({"database_url": database_url, "redis_url": redis_url,
                      "started": started}), flush=True)
    while not (home.parent / "release").exists():
        time.sleep(0.01)
    """
)


@pytest.fixture
def home() -> Iterator[Path]:
    # Not under pytest's tmp_path: as root, every pytest session resets its base folder to
    # 0700, which would lock the embedded PostgreSQL's own account out mid-test.
    base = Path(tempfile.mkdtemp(prefix="fluxora-embedded-test-"))
    folder = base / "home"
    yield folder
    _kill_children()
    stop_embedded(folder)
    # The safety net: whatever a failed test left running goes now.
    for process in _server_processes(folder):
        process.kill()
    shutil.rmtree(base, ignore_errors=True)


_children: list[subprocess.Popen[str]] = []


def _kill_children() -> None:
    while _children:
        child = _children.pop()
        if child.poll() is None:
            child.kill()
        child.communicate(timeout=30)


def _spawn_user(home: Path, tag: str) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, "-c", USER_SCRIPT, str(home), tag],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _children.append(child)
    return child


def _report(child: subprocess.Popen[str]) -> dict[str, str]:
    assert child.stdout is not None
    line = child.stdout.readline()
    if not line:
        _, err = child.communicate(timeout=30)
        pytest.fail(f"user process failed:\n{err}")
    report: dict[str, str] = json.loads(line)
    return report


def _alive(process: psutil.Process) -> bool:
    try:
        return bool(process.is_running() and process.status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def _server_processes(home: Path) -> list[psutil.Process]:
    """Every live postgres process (postmaster and children) and redis-server of ``home``."""
    folders = {"postgres": str(home.resolve() / "postgres"), "redis": str(home.resolve() / "redis")}
    found = []
    for process in psutil.process_iter(["name"]):
        try:
            name = process.info["name"] or ""
            ours = (name == "postgres" and process.cwd() == folders["postgres"]) or (
                name.startswith("redis-server") and process.cwd() == folders["redis"]
            )
            if ours:
                found.append(process)
        except psutil.Error:
            continue
    return [p for p in found if _alive(p)]


def _postmaster(home: Path) -> psutil.Process:
    pid = int((home / "postgres" / "postmaster.pid").read_text().split()[0])
    return psutil.Process(pid)


def _redis_server(home: Path) -> psutil.Process:
    (process,) = [p for p in _server_processes(home) if p.name().startswith("redis-server")]
    return process


def _wait_until(condition: object, timeout: float = 30.0) -> None:
    assert callable(condition)
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _assert_one_server_each(home: Path) -> None:
    postmaster = _postmaster(home)
    processes = _server_processes(home)
    postgres = [p for p in processes if p.name() == "postgres"]
    redis_servers = [p for p in processes if p.name().startswith("redis-server")]
    assert all(p.pid == postmaster.pid or p.ppid() == postmaster.pid for p in postgres)
    assert len(redis_servers) == 1


def _no_tcp_listeners(process: psutil.Process) -> bool:
    return not [c for c in process.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]


def test_first_start_then_reuse_keeps_data(home: Path) -> None:
    home.mkdir()
    leftover = home / ".postgres-init-1-dead"  # a scratch folder of a crashed initdb
    (leftover / "base").mkdir(parents=True)

    with EmbeddedEngines(home) as engines:
        url = engines.database_url()
        assert "dbname" not in url and "/fluxora?" in url
        with psycopg.connect(url, autocommit=True) as conn:
            assert conn.execute("SELECT current_database()").fetchone() == ("fluxora",)
            assert conn.execute("SHOW max_connections").fetchone() == ("200",)
            assert conn.execute("SHOW fsync").fetchone() == ("on",)
            assert conn.execute("SHOW listen_addresses").fetchone() == ("",)
            conn.execute("CREATE TABLE kept (value int)")
            conn.execute("INSERT INTO kept VALUES (42)")
        postmaster = _postmaster(home)
        assert _no_tcp_listeners(postmaster)
        if os.geteuid() == 0:  # PostgreSQL refuses root; it runs as its own account
            assert postmaster.uids().real != 0

        # A second user in the same process reuses the running server.
        with EmbeddedEngines(home) as again:
            assert again.database_url() == url
            assert _postmaster(home).pid == postmaster.pid
        assert _alive(postmaster), "the first user still holds the server"
    assert not leftover.exists()
    _wait_until(lambda: not _alive(postmaster))
    assert _server_processes(home) == []

    inode = (home / "postgres" / "PG_VERSION").stat().st_ino
    with EmbeddedEngines(home) as engines, psycopg.connect(engines.database_url()) as conn:
        assert conn.execute("SELECT value FROM kept").fetchall() == [(42,)]
    assert (home / "postgres" / "PG_VERSION").stat().st_ino == inode, "not re-initialised"
    assert _server_processes(home) == []


def test_two_processes_at_once_share_one_server(home: Path) -> None:
    first, second = _spawn_user(home, "a"), _spawn_user(home, "b")
    (home.parent / "go").touch()
    reports = [_report(first), _report(second)]

    assert reports[0] == reports[1]
    _assert_one_server_each(home)
    with psycopg.connect(reports[0]["database_url"]) as conn:
        tags = conn.execute("SELECT tag FROM marks ORDER BY tag").fetchall()
    assert tags == [("a",), ("b",)]

    (home.parent / "release").touch()
    assert first.wait(30) == 0 and second.wait(30) == 0
    _wait_until(lambda: _server_processes(home) == [])


def test_server_stays_up_while_a_holder_remains(home: Path) -> None:
    (home.parent / "go").touch()
    (home.parent / "release").touch()
    with EmbeddedEngines(home) as engines:
        url = engines.database_url()
        postmaster = _postmaster(home)
        child = _spawn_user(home, "passer-by")
        assert _report(child)["database_url"] == url
        assert child.wait(30) == 0
        # The passer-by left first: the server is ours still.
        assert _alive(postmaster)
        with psycopg.connect(url) as conn:
            assert conn.execute("SELECT tag FROM marks").fetchall() == [("passer-by",)]
    _wait_until(lambda: _server_processes(home) == [])


def test_recovers_after_its_owner_is_sigkilled(home: Path) -> None:
    (home.parent / "go").touch()
    child = _spawn_user(home, "crashed")
    report = _report(child)
    postmaster, redis_server = _postmaster(home), _redis_server(home)
    child.send_signal(signal.SIGKILL)
    child.wait(30)

    # The orphaned servers are reused, then stopped when this (now last) user leaves.
    with EmbeddedEngines(home) as engines:
        assert engines.database_url() == report["database_url"]
        assert engines.redis_url() == report["redis_url"]
        assert _postmaster(home).pid == postmaster.pid
        assert _redis_server(home).pid == redis_server.pid
    _wait_until(lambda: _server_processes(home) == [])


def test_recovers_after_the_servers_are_sigkilled(home: Path) -> None:
    (home.parent / "go").touch()
    child = _spawn_user(home, "before the crash")
    _report(child)
    victims = [child.pid, *(p.pid for p in _server_processes(home))]
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):  # one that ended meanwhile is as good
            os.kill(pid, signal.SIGKILL)
    child.wait(30)
    _wait_until(lambda: _server_processes(home) == [])
    # Stale files, and a postmaster.pid naming a live process that is not PostgreSQL (pids
    # are reused): PostgreSQL alone would refuse to start over it.
    assert (home / "redis" / "redis.sock").exists()
    assert (home / "redis" / "redis.pid").exists()
    stale = (home / "postgres" / "postmaster.pid").read_text().splitlines()
    stale[0] = str(os.getpid())
    (home / "postgres" / "postmaster.pid").write_text("\n".join(stale) + "\n")

    with EmbeddedEngines(home) as engines:
        with psycopg.connect(engines.database_url()) as conn:
            # Committed before the crash, so it survived it.
            assert conn.execute("SELECT tag FROM marks").fetchall() == [("before the crash",)]
        client = redis.Redis.from_url(engines.redis_url())
        assert client.ping()
        client.close()
        _assert_one_server_each(home)
    _wait_until(lambda: _server_processes(home) == [])


async def test_redis_runs_lua_through_redis_asyncio(home: Path) -> None:
    with EmbeddedEngines(home) as engines:
        url = engines.redis_url()
        assert url.startswith("unix://")
        client = redis.asyncio.from_url(url)
        try:
            seconds, micros = await client.eval("return redis.call('TIME')", 0)
            assert abs(int(seconds) - time.time()) < 5 and 0 <= int(micros) < 1_000_000
            assert await client.set("k", "v") and await client.get("k") == b"v"
        finally:
            await client.aclose()
        assert _no_tcp_listeners(_redis_server(home))
    _wait_until(lambda: _server_processes(home) == [])


def test_stop_embedded_stops_orphans_but_not_engines_in_use(home: Path) -> None:
    (home.parent / "go").touch()
    child = _spawn_user(home, "holder")
    _report(child)
    assert stop_embedded(home) is False, "a live process holds the engines"
    assert _server_processes(home) != []

    child.send_signal(signal.SIGKILL)
    child.wait(30)
    assert stop_embedded(home) is True
    assert _server_processes(home) == []
    assert stop_embedded(home) is True, "idempotent"


def test_plain_functions_hold_until_the_process_exits(home: Path) -> None:
    script = textwrap.dedent(
        """
        import sys
        from pathlib import Path
        from fluxora_webhooks.embedded import embedded_database_url, embedded_redis_url
        home = Path(sys.argv[1])
        assert embedded_database_url(home) == embedded_database_url(home)
        embedded_redis_url(home)
        print("up", flush=True)
        sys.stdin.readline()
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script, str(home)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    _children.append(child)
    assert child.stdout is not None and child.stdout.readline() == "up\n"
    assert len(_server_processes(home)) > 1
    child.communicate("\n", timeout=60)  # a normal exit runs the atexit release
    assert child.returncode == 0
    _wait_until(lambda: _server_processes(home) == [])


def test_long_home_path_puts_sockets_in_a_short_private_folder(home: Path) -> None:
    home = home.parent / ("a-rather-long-folder-name-" * 4) / "home"
    try:
        with EmbeddedEngines(home) as engines:
            database_url, redis_url = engines.database_url(), engines.redis_url()
            assert "host=/tmp/fluxora-" in database_url
            assert redis_url.startswith("unix:///tmp/fluxora-")
            with psycopg.connect(database_url) as conn:
                assert conn.execute("SELECT 1").fetchone() == (1,)
            client = redis.Redis.from_url(redis_url)
            assert client.ping()
            client.close()
        assert _server_processes(home) == []
        assert not Path(redis_url.removeprefix("unix://")).parent.exists()
    finally:
        stop_embedded(home)


def test_refuses_a_data_folder_that_is_not_postgresql(home: Path) -> None:
    (home / "postgres").mkdir(parents=True)
    (home / "postgres" / "notes.txt").write_text("mine")
    with pytest.raises(EmbeddedEngineError, match="not a PostgreSQL data folder"):
        embedded_database_url(home)
    with (
        EmbeddedEngines(home) as engines,
        pytest.raises(EmbeddedEngineError, match="not a PostgreSQL data folder"),
    ):
        engines.database_url()
    assert (home / "postgres" / "notes.txt").read_text() == "mine"


def test_describe_names_the_folder_and_the_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert describe(Path(".fluxora")) == (
        "Running on the embedded PostgreSQL and Redis in ./.fluxora "
        "(set DATABASE_URL and REDIS_URL to use your own)"
    )
    assert describe(tmp_path / ".fluxora", redis=False) == (
        "Running on the embedded PostgreSQL in ./.fluxora (set DATABASE_URL to use your own)"
    )
    assert describe(Path("/elsewhere/x"), postgres=False) == (
        "Running on the embedded Redis in /elsewhere/x (set REDIS_URL to use your own)"
    )
