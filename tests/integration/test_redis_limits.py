"""The delivery gate on constrained Redis servers of the test's own: a bounded number of
connections however many reports go at once, a client's own connection cap and a Redis
out of memory are no outage, a Redis that may evict the gate's keys is warned about, and a
REDIS_URL that can never work (credentials, an ACL without a command, a read-only replica,
TLS not verified, a TLS file missing, an option redis-py cannot take) stops start-up with a
configuration error naming REDIS_URL, while a Redis that is down does not."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import shutil
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from fluxora_webhooks import redis_gate
from fluxora_webhooks.errors import ConfigError
from fluxora_webhooks.gate import ALLOW, Admission
from fluxora_webhooks.metrics import REGISTRY
from fluxora_webhooks.redis_gate import (
    RedisGate,
    breaker_key,
    connect_gate,
    rate_limit_key,
    read_breaker_state,
)
from fluxora_webhooks.settings import EngineSettings, Settings
from tests.support.procs import command_env, dispatcher_env
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.integration

URL = "https://consumer.example/hooks"
DENIED = Admission(False, delay_ms=1000, reason="rate_limited")
LOGGER = "fluxora_webhooks.redis_gate"
PASSWORD = "right-pw-5f3a"
WRONG = "wrong-pw-77c1"
# The ACL of docs/operations.md, command by command.
ACL_COMMANDS = (
    "evalsha", "script|load", "ping", "time", "zremrangebyscore", "zcard", "zadd", "pexpire",
    "hmget", "hset", "del", "get", "set", "pttl", "hgetall", "zcount", "exists",
)  # fmt: skip
ACL_KEYS = ("~webhook_rl:*", "~webhook_cb:*", "~webhook_cb_probe:*")
# What the breaker alone needs: a gate without it runs without them.
BREAKER_COMMANDS = {"hmget", "hset", "del", "get", "set", "pttl", "hgetall"}
# What only `status` reads.
STATUS_ONLY = {"zcount"}
# What the gate uses only to try a failing node again (a refusal is an answer too).
OPTIONAL = {"exists"}


def fail_opens(component: str) -> float:
    labels = {"component": component}
    return REGISTRY.get_sample_value("fluxora_webhook_redis_fail_open_total", labels) or 0.0


def gate_lines(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == LOGGER and r.levelno == logging.WARNING and text in r.getMessage()
    ]


def port_in_range() -> int:
    """A free loopback port of 47610-47699 (this suite's range for its own servers)."""
    for port in random.sample(range(47610, 47700), 90):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port in 47610-47699")


class OwnRedis(RedisServer):
    """A redis-server of the test's own with extra options (``args``)."""

    def __init__(self, directory: Path, *args: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        super().__init__(port_in_range(), directory)
        self.args = list(args)
        self.tls_port = port_in_range()  # where "{tls_port}" in args says

    def new_ports(self) -> None:
        self.port, self.tls_port = port_in_range(), port_in_range()

    def options(self) -> list[str]:
        return [arg.replace("{tls_port}", str(self.tls_port)) for arg in self.args]

    def url(self, auth: str = "") -> str:
        return f"redis://{auth}127.0.0.1:{self.port}/0"


@contextlib.contextmanager
def own_redis(directory: Path, *args: str) -> Iterator[OwnRedis]:
    server = OwnRedis(directory, *args)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[OwnRedis]:
    with own_redis(tmp_path) as started:
        yield started


@pytest.fixture
async def admin(server: OwnRedis) -> AsyncIterator[Redis]:
    client = Redis(host="127.0.0.1", port=server.port)
    try:
        yield client
    finally:
        await client.aclose()


async def gate_at(url: str, **options: Any) -> RedisGate:
    # The start-up check's bound is long: on a loaded machine a TLS handshake can outlast
    # the default 750 ms, and a Redis that does not answer in time passes the check.
    settings: dict[str, Any] = {
        "retry_rps": 1, "breaker_threshold": 1, "breaker_reset_ms": 60_000,
        "probe_ttl_ms": 1_000, "timeout_ms": 5_000, **options,
    }  # fmt: skip
    async with asyncio.timeout(10):
        return await connect_gate(url, **settings)


async def add_user(admin: Redis, name: str, commands: Sequence[str]) -> None:
    """``name`` with PASSWORD, the gate's keys and ``commands`` only (ACL SETUSER)."""
    send: Callable[..., Awaitable[Any]] = admin.execute_command  # untyped in redis-py
    await send(
        "ACL", "SETUSER", name, "on", f">{PASSWORD}", "resetkeys", *ACL_KEYS, "-@all",
        *(f"+{c}" for c in commands),
    )  # fmt: skip


async def run_cli(*args: str, env: dict[str, str], timeout: float = 30) -> tuple[int, str]:
    """``python -m fluxora_webhooks ARGS``: its exit status and output; killed (and the
    test failed) when it does not end within ``timeout``."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fluxora_webhooks", *args, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        pytest.fail(f"`{' '.join(args)}` did not stop within {timeout} s")
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace")


# -- connections ------------------------------------------------------------------------


async def test_reports_at_once_share_a_bounded_number_of_connections(
    server: OwnRedis, admin: Redis
) -> None:
    """160 consumers failing at once (one batch's reports, all at once): the gate holds at
    most its bound of connections, more calls wait for one instead of opening more, and
    none fails open (redis-py's pool of 100 raised MaxConnectionsError beyond it)."""
    client = Redis(host="127.0.0.1", port=server.port, client_name="gate")
    gate = RedisGate(
        client, retry_rps=5, breaker_threshold=1_000, breaker_reset_ms=60_000,
        probe_ttl_ms=1_000, timeout_ms=5_000,
    )  # fmt: skip
    urls = [f"{URL}/{i}" for i in range(160)]
    before = fail_opens("breaker")
    try:
        await gate.report(urls[0], [(ALLOW, False)])  # loads the script
        await admin.client_pause(300, all=False)  # write commands wait: the calls overlap
        async with asyncio.timeout(30):
            await asyncio.gather(*(gate.report(url, [(ALLOW, False)]) for url in urls))
        held = [c for c in await admin.client_list() if c["name"] == "gate"]
        assert fail_opens("breaker") == before
        assert gate.available
        states = [await read_breaker_state(admin, url) for url in urls]
        assert [s.failures for s in states] == [2] + [1] * 159
        from fluxora_webhooks.redis_gate import GATE_CONNECTIONS

        # Its own (the reports took at most GATE_CONNECTIONS - 2 of them), and the pooled
        # connection that loaded the script.
        assert len(held) <= GATE_CONNECTIONS + 1, f"{len(held)} connections"
    finally:
        await gate.close()
        await client.aclose()


async def test_a_client_pool_at_its_cap_is_no_outage(server: OwnRedis, admin: Redis) -> None:
    """A pool capped by the URL (?max_connections=4): the gate stays below the cap, and
    every report is recorded; nothing is taken for a Redis outage."""
    client = Redis.from_url(server.url() + "?max_connections=4", client_name="capped")
    gate = RedisGate(
        client, retry_rps=5, breaker_threshold=1_000, breaker_reset_ms=60_000,
        probe_ttl_ms=1_000, timeout_ms=5_000, failure_backoff_ms=60_000,
    )  # fmt: skip
    urls = [f"{URL}/{i}" for i in range(40)]
    before = fail_opens("breaker"), fail_opens("gate")
    try:
        await gate.report(urls[0], [(ALLOW, False)])
        await gate.admit(urls[0], [2])
        async with asyncio.timeout(30):
            await asyncio.gather(
                *(gate.report(url, [(ALLOW, False)]) for url in urls),
                *(gate.admit(url, [2]) for url in urls),
            )
        assert (fail_opens("breaker"), fail_opens("gate")) == before
        assert gate.available
        assert len([c for c in await admin.client_list() if c["name"] == "capped"]) <= 4
        for url in urls:
            assert (await read_breaker_state(admin, url)).failures >= 1
    finally:
        await gate.close()
        await client.aclose()


# -- memory -----------------------------------------------------------------------------


async def test_a_redis_that_may_evict_the_gate_keys_is_warned_about_once(
    server: OwnRedis, admin: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    for memory, policy, warned in (
        ("64mb", "volatile-lru", True),
        ("64mb", "allkeys-lru", True),
        ("64mb", "noeviction", False),
        ("0", "allkeys-lru", False),  # no maxmemory: nothing is evicted
    ):
        await admin.config_set("maxmemory", memory)
        await admin.config_set("maxmemory-policy", policy)
        caplog.clear()
        gate = await gate_at(server.url())
        await gate.close()
        lines = gate_lines(caplog, "may evict the delivery gate's keys")
        assert len(lines) == (1 if warned else 0), (policy, lines)
        if warned:
            assert policy in lines[0] and "noeviction" in lines[0]
    await admin.config_set("maxmemory", "64mb")
    await admin.config_set("maxmemory-policy", "volatile-lru")
    caplog.clear()
    gate = await gate_at(server.url(), warn_eviction=False)  # another worker said it
    await gate.close()
    assert not gate_lines(caplog, "may evict")


async def test_out_of_memory_refusals_do_not_switch_off_the_rate_limit(
    server: OwnRedis, admin: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """Under noeviction out of memory, the breaker's writes are refused while the rate
    limit still decides: each refused call goes ahead alone (counted, logged once), and
    the gate never stops asking Redis for its back-off."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    client = Redis(host="127.0.0.1", port=server.port)
    gate = RedisGate(
        client, retry_rps=1, breaker_threshold=3, breaker_reset_ms=60_000,
        probe_ttl_ms=1_000, window_ms=30_000, timeout_ms=5_000, failure_backoff_ms=60_000,
    )  # fmt: skip
    denied = Admission(False, delay_ms=30_000, reason="rate_limited")
    try:
        assert await gate.admit(URL, [2]) == [ALLOW]
        await admin.config_set("maxmemory-policy", "noeviction")
        await admin.config_set("maxmemory", "1")  # always over: every first write refused
        before = fail_opens("breaker"), fail_opens("gate")
        for _ in range(3):
            await gate.report(URL, [(ALLOW, False)])  # HSET: refused
        assert fail_opens("breaker") - before[0] == 3
        assert gate.available
        # Still decided by Redis: the window holds one attempt, the limit is one.
        assert await gate.admit(URL, [2]) == [denied]
        # The admit script's first write (ZREMRANGEBYSCORE) frees nothing but is not refused,
        # and Redis lets a script that has written go on: new consumers are limited too.
        assert await gate.admit(f"{URL}/new", [2, 2]) == [ALLOW, denied]
        assert fail_opens("gate") == before[1]
        assert await gate.admit(URL, [2]) == [denied]
        assert gate.available
        lines = gate_lines(caplog, "refused a delivery gate call")
        assert len(lines) == 1, lines  # said once, not per call
        assert "OutOfMemoryError" in lines[0] and "out of memory" in lines[0]
        assert not gate_lines(caplog, "unavailable")
    finally:
        await admin.config_set("maxmemory", "0")
        await gate.close()
        await client.aclose()


# -- start-up: what can never work ----------------------------------------------------


async def test_credentials_refused_stop_start_up_and_later_fail_open(
    server: OwnRedis, admin: Redis
) -> None:
    await admin.config_set("requirepass", PASSWORD)
    await admin.auth(PASSWORD)
    for auth in (f":{WRONG}@", "", f"nobody:{WRONG}@"):
        with pytest.raises(ConfigError) as caught:
            await gate_at(server.url(auth))
        assert caught.value.variable == "REDIS_URL"
        expected = "asks for a password and REDIS_URL gives none" if not auth else "refused"
        assert expected in str(caught.value), str(caught.value)
        assert WRONG not in str(caught.value)
    gate = await gate_at(server.url(f":{PASSWORD}@"))
    try:
        assert await gate.admit(URL, [2, 2]) == [ALLOW, DENIED]
        # After a good start, a password changed under the gate is an outage: fail open.
        await admin.config_set("requirepass", WRONG)
        await admin.client_kill_filter(skipme=True)
        assert await gate.admit(URL, [2, 2]) == [ALLOW, ALLOW]
    finally:
        await gate.close()
    # Nothing listens there: an outage, as before, whatever the password (fails open).
    gate = await gate_at(f"redis://:{WRONG}@127.0.0.1:{port_in_range()}/0")
    try:
        assert not gate.available
        assert await gate.admit(URL, [2, 2]) == [ALLOW, ALLOW]
    finally:
        await gate.close()


async def test_the_documented_acl_serves_the_gate_and_each_command_it_lacks_stops_start_up(
    server: OwnRedis, admin: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """docs/operations.md's ACL, checked command by command: all of them serve the gate,
    the breaker, the service's breaker reading and `status` (CONFIG refused: the eviction
    check says nothing); any one missing that `run` needs stops it naming the command."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    await admin.config_set("maxmemory", "64mb")
    await admin.config_set("maxmemory-policy", "allkeys-lru")  # not readable by the user
    await add_user(admin, "fx", ACL_COMMANDS)
    url = server.url(f"fx:{PASSWORD}@")
    gate = await gate_at(url, breaker_threshold=1)
    try:
        assert await gate.admit(URL, [2, 2]) == [ALLOW, DENIED]
        await gate.report(URL, [(ALLOW, False)])
        assert [a.reason for a in await gate.admit(URL, [1])] == ["circuit_open"]
        assert gate.available
    finally:
        await gate.close()
    assert not gate_lines(caplog, "evict") and not gate_lines(caplog, "refuse")

    def refused(caught: pytest.ExceptionInfo[ConfigError], missing: str) -> None:
        text = str(caught.value)
        assert caught.value.variable == "REDIS_URL"
        assert missing.split("|")[0] in text.lower(), (missing, text)
        assert "ACL" in text and PASSWORD not in text

    for missing in ACL_COMMANDS:
        if missing in STATUS_ONLY:
            continue
        if missing in OPTIONAL:  # started without it
            await add_user(admin, "fx", [c for c in ACL_COMMANDS if c != missing])
            await (await gate_at(url, breaker_threshold=1)).close()
            continue
        await add_user(admin, "fx", [c for c in ACL_COMMANDS if c != missing])
        with pytest.raises(ConfigError) as caught:
            await gate_at(url, breaker_threshold=1)
        refused(caught, missing)
        if missing in BREAKER_COMMANDS:  # the gate without a breaker does without them
            await (await gate_at(url, breaker_threshold=0)).close()

    # What `status` reads: the whole ACL serves it, and without ZCOUNT it stops (exit 2).
    from fluxora_webhooks.redis_connect import check_usable

    reads: list[tuple[str | int, ...]] = [
        ("TIME",), ("HGETALL", breaker_key(URL)), ("ZCOUNT", rate_limit_key(URL), 0, 0),
    ]  # fmt: skip
    await add_user(admin, "fx", ACL_COMMANDS)
    await check_usable(url, reads)
    for missing in STATUS_ONLY:
        await add_user(admin, "fx", [c for c in ACL_COMMANDS if c != missing])
        await (await gate_at(url)).close()  # started: `run` does not need it
        with pytest.raises(ConfigError) as caught:
            await check_usable(url, reads)
        refused(caught, missing)


async def test_a_read_only_replica_is_said_and_fails_open_not_a_stop(
    tmp_path: Path, server: OwnRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """During a failover the URL's name may reach a replica for seconds: start-up says so
    and goes on, each refused call without the gate (a stop would take every worker down
    while Redis, a protection, is being failed over)."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    replica = own_redis(tmp_path / "replica", "--replicaof", "127.0.0.1", str(server.port))
    with replica as started:
        gate = await gate_at(started.url(), breaker_threshold=0)
        try:
            assert gate_lines(caplog, "READONLY")
            assert await gate.admit(URL, [2]) == [ALLOW]
        finally:
            await gate.close()


def make_tls_files(folder: Path) -> dict[str, Path]:
    """A CA and a server certificate for 127.0.0.1 signed by it (openssl, a second or so),
    and a CA that signed nothing."""
    folder.mkdir()

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True, timeout=60)

    subj = "/CN=fluxora-test-ca"
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
            "ca.crt", "-days", "2", "-subj", subj)  # fmt: skip
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "other.key", "-out",
            "other.crt", "-days", "2", "-subj", "/CN=other")  # fmt: skip
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out",
            "server.csr", "-subj", "/CN=127.0.0.1")  # fmt: skip
    (folder / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "server.crt", "-days", "2",
            "-extfile", "ext.cnf")  # fmt: skip
    return {name: folder / f"{name}.crt" for name in ("ca", "other", "server")} | {
        "key": folder / "server.key"
    }


async def test_tls_not_verified_or_a_missing_ca_file_stops_start_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert shutil.which("openssl"), "openssl (Debian's, on every machine here) makes the CA"
    # The handshake within the connect timeout however loaded the machine (a connection
    # that times out is an outage, which the check lets pass): what is asserted is what a
    # handshake that fails is called.
    monkeypatch.setattr(redis_gate, "CONNECT_TIMEOUT_S", 5.0)
    files = make_tls_files(tmp_path / "tls")
    server = OwnRedis(
        tmp_path / "data", "--tls-port", "{tls_port}", "--tls-cert-file", str(files["server"]),
        "--tls-key-file", str(files["key"]), "--tls-ca-cert-file", str(files["ca"]),
        "--tls-auth-clients", "no",
    )  # fmt: skip
    try:
        server.start()
    except AssertionError:
        server.stop()
        pytest.skip("this redis-server has no TLS")
    tls_port = server.tls_port
    try:
        base = f"rediss://:{WRONG}@127.0.0.1:{tls_port}/0"
        for url, said in (
            (base, "certificate"),  # the system's CAs: not ours
            (f"{base}?ssl_ca_certs={files['other']}", "certificate"),
            (f"{base}?ssl_ca_certs={tmp_path}/missing-ca.pem", f"{tmp_path}/missing-ca.pem"),
        ):
            with pytest.raises(ConfigError) as caught:
                await gate_at(url)
            assert caught.value.variable == "REDIS_URL"
            assert said in str(caught.value), str(caught.value)
            assert WRONG not in str(caught.value)
        gate = await gate_at(f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={files['ca']}")
        try:
            assert await gate.admit(URL, [2, 2]) == [ALLOW, DENIED]
        finally:
            await gate.close()
    finally:
        server.stop()


def test_url_options_redis_py_cannot_take_are_configuration_errors() -> None:
    for query, said in (
        ("ssl_cert_reqs=bogus", "ssl_cert_reqs must be none, optional or required"),
        ("socket_timeout=abc", "socket_timeout"),
        ("sslmode=require", "sslmode"),
    ):
        url = f"rediss://:{WRONG}@cache:6379/0?{query}"
        for parse in (EngineSettings.from_env, Settings.from_env):
            with pytest.raises(ConfigError) as caught:
                parse({"REDIS_URL": url, "DATABASE_URL": "postgresql://db/app"})
            assert caught.value.variable == "REDIS_URL"
            assert said in str(caught.value) and WRONG not in str(caught.value)
    with pytest.raises(ConfigError, match="need a rediss:// URL"):
        EngineSettings.from_env({"REDIS_URL": "redis://cache/0?ssl_ca_certs=/ca.pem"})
    EngineSettings.from_env({"REDIS_URL": "redis://cache/0?health_check_interval=30"})


async def test_run_and_status_stop_with_exit_2_naming_redis_url(
    server: OwnRedis, admin: Redis, database_url: str
) -> None:
    """The commands themselves: `run` stops at start-up (it went ready and failed open for
    ever), `status` and `api` too (status called refused credentials "unreachable"); an option
    redis-py cannot take is a configuration error, not a traceback. Redis down is still no
    error for either."""
    await admin.config_set("requirepass", PASSWORD)
    wrong = server.url(f":{WRONG}@")
    env = dispatcher_env(database_url, wrong, "https://consumer.example/hooks", "")
    for command in ("run", "status", "api"):
        # `api` reads breakers only; it would serve on this port (with the API extra).
        code, out = await run_cli(command, env={**env, "WEBHOOK_API_PORT": str(port_in_range())})
        assert code == 2, (command, out)
        assert "REDIS_URL" in out and "AuthenticationError" in out, out
        assert WRONG not in out and "Traceback" not in out, out
    bad_option = {**env, "REDIS_URL": server.url() + "?socket_timeout=abc"}
    code, out = await run_cli("run", env=bad_option)
    assert code == 2 and "REDIS_URL" in out and "Traceback" not in out, out

    down = command_env(
        DATABASE_URL=database_url, REDIS_URL=f"redis://127.0.0.1:{port_in_range()}/0",
        WEBHOOK_URL="https://consumer.example/hooks",
    )  # fmt: skip
    code, out = await run_cli("status", env=down)
    assert code == 0 and "unreachable: ConnectionError" in out, out


def test_status_says_refused_not_unreachable(capsys: pytest.CaptureFixture[str]) -> None:
    """The text report: an outage is "unreachable", an answer that refused is not."""
    from fluxora_webhooks.commands.status import render

    snapshot: dict[str, Any] = {
        "at": "2026-01-05T10:12:03+00:00",
        "backlog": {"pending": 0, "due_now": 0, "oldest_due_age_seconds": 0,
                    "next_due_in_seconds": None, "estimated": False, "egress_held": 0},
        "dead_letters": {"waiting": 0},
        "recent": {"minutes": 15, "attempts": {}, "duration_ms": {}},
        "endpoints": None,
    }  # fmt: skip
    snapshot["recent"]["attempts"] = {o: 0 for o in ("delivered", "retry", "dead_letter")}
    for error, said in (
        ("ConnectionError: Error 111 connecting", "unreachable: ConnectionError"),
        ("TimeoutError", "unreachable: TimeoutError"),
        (None, "unreachable: no answer"),
        ("AuthenticationError: invalid password", "refused: AuthenticationError"),
        ("NoPermissionError: no permissions to run 'zcount'", "refused: NoPermissionError"),
        ("OutOfMemoryError: command not allowed", "refused: OutOfMemoryError"),
    ):
        redis = {"url": "redis://cache:6379", "reachable": False, "error": error}
        snapshot["consumer"] = {"endpoint": "https://consumer.example", "redis": redis}
        render(snapshot)
        out = capsys.readouterr().out
        assert said in out, (error, out)
        if said.startswith("refused"):
            assert "unreachable" not in out
