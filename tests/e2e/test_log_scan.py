"""No secret and no full URL in any log line or metric: the service is driven through
deliveries, retries, dead letters, refused connections, timeouts, a Redis that refuses its
password (start-up stops) and one that is down (the gate fails open), in JSON and in text,
and everything it wrote is scanned."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

import aiohttp
import psycopg
import pytest
import yarl
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from fluxora_webhooks import logs
from tests.e2e.test_observability import ServiceProcess, running_service
from tests.support.dispatch import pending, rows, wait_until
from tests.support.procs import dispatcher_env, free_port, run_command
from tests.support.receiver import Received, Receiver

pytestmark = pytest.mark.e2e

SECRET = "log-scan-secret-0123456789-abcdefghijkl"
PREVIOUS = "log-scan-previous-secret-9876543210-zyx"
QUERY_TOKEN = "sekrit-query-token"  # in the receiver fixture's URL
DB_PASSWORD = "db-password-never-logged"
REDIS_PASSWORD = "redis-password-never-logged"


def _leaks(text: str) -> list[str]:
    return [
        s
        for s in (SECRET, PREVIOUS, QUERY_TOKEN, DB_PASSWORD, REDIS_PASSWORD, "/hook")
        if s in text
    ]


def _with_password(url: str, password: str) -> str:
    scheme, rest = url.split("://", 1)
    # Redis: a user that does not exist, so AUTH fails and the gate fails open.
    user = "postgres" if scheme.startswith("postgres") else "fluxora-nobody"
    if "@" in rest:
        user, rest = rest.split("@", 1)
        user = user.split(":", 1)[0]
    return f"{scheme}://{user}:{password}@{rest}"


async def _enqueue(database_url: str, kinds: list[str]) -> None:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload)"
            " SELECT 's-' || n, 'stream.updated', jsonb_build_object('kind', k)"
            " FROM unnest(%s::text[]) WITH ORDINALITY AS t(k, n) ORDER BY n",
            (kinds,),
        )


async def _idle(database_url: str) -> bool:
    return await pending(database_url) == 0


@pytest.mark.slow
@pytest.mark.parametrize("log_format", ["json", "text"])
async def test_logs_and_metrics_never_carry_a_secret_or_a_full_url(
    database_url: str,
    redis_url: str,
    redis_prefix: str,
    receiver: Receiver,
    tmp_path: Path,
    log_format: str,
) -> None:
    async def respond(r: Received) -> web.Response:
        kind = json.loads(r.body)["kind"]
        if kind == "gone":
            return web.Response(status=410, text=f"no such hook; your secret is {SECRET}")
        if kind == "flaky" and r.attempt == 1:
            return web.Response(status=503, headers={"Retry-After": "0"})
        if kind == "slow":
            await asyncio.sleep(1.0)
        return web.Response(status=200)

    receiver.respond = respond
    assert QUERY_TOKEN in receiver.url
    with socket.socket() as sock:  # a port nothing listens on: connections are refused
        sock.bind(("127.0.0.1", 0))
        refused_port = sock.getsockname()[1]
    common = {
        "LOG_FORMAT": log_format,
        "LOG_LEVEL": "DEBUG",
        "WEBHOOK_SECRET": SECRET,
        "WEBHOOK_SECRET_PREVIOUS": PREVIOUS,
        "WEBHOOK_MAX_ATTEMPTS": "2",
        "WEBHOOK_RETRY_SCHEDULE": "50ms",
        "WEBHOOK_TIMEOUT_MS": "300",
        "WEBHOOK_POLL_INTERVAL_MS": "200",
        "WEBHOOK_CIRCUIT_BREAKER_THRESHOLD": "5",
    }
    db_url = _with_password(database_url, DB_PASSWORD)  # trust auth: accepted, unused
    bad_redis = _with_password(redis_url, REDIS_PASSWORD)  # refused by a Redis without auth
    # The same password for a Redis that is down: the gate fails open.
    down_redis = _with_password(f"redis://127.0.0.1:{free_port()}/0", REDIS_PASSWORD)
    logs_seen: list[str] = []
    metrics_seen: list[str] = []

    # 0. A Redis that refuses its password: `run` stops at start-up, naming REDIS_URL.
    env = dispatcher_env(
        db_url, bad_redis, receiver.url, redis_prefix, WEBHOOK_METRICS_PORT="0", **common
    )
    code, out = await run_command("run", env=env, timeout=60)
    assert code == 2 and "REDIS_URL" in out, out
    logs_seen.append(out)

    # 1. A live consumer: delivered, retried, dead-lettered (410 and timeouts).
    port = free_port()
    env = dispatcher_env(
        db_url, down_redis, receiver.url, redis_prefix, WEBHOOK_METRICS_PORT=str(port), **common
    )
    async with running_service(env, tmp_path / "live.log") as service:
        await _enqueue(database_url, ["ok", "ok", "gone", "flaky", "slow"])
        await wait_until(lambda: _idle(database_url), timeout=30, what="live consumer done")
        metrics_seen.append(await service.metrics_text())
    logs_seen.append(service.proc.log())

    # 2. A consumer that refuses connections, with the same token in its URL.
    refused_url = f"http://127.0.0.1:{refused_port}/hook?token={QUERY_TOKEN}"
    env = dispatcher_env(
        db_url,
        redis_url,
        refused_url,
        redis_prefix,
        WEBHOOK_METRICS_PORT=str(free_port()),
        **common,
    )
    async with running_service(env, tmp_path / "refused.log") as service:
        await _enqueue(database_url, ["ok", "ok"])
        await wait_until(lambda: _idle(database_url), timeout=30, what="refused consumer done")
        metrics_seen.append(await service.metrics_text())
    logs_seen.append(service.proc.log())

    outcomes = await rows(
        database_url,
        "SELECT outcome, count(*) FROM webhook_outbox GROUP BY outcome ORDER BY outcome",
    )
    # The run went through every path: 3 delivered (2 ok + flaky), retries of flaky, slow
    # and both refused events, dead letters for gone, slow (timeouts) and the refused ones.
    assert outcomes == [("dead_letter", 4), ("delivered", 3), ("retry", 4)]
    errors = [r[0] for r in await rows(database_url, "SELECT error FROM webhook_outbox")]
    assert "timeout" in errors
    assert any(e and "connection failed" in e for e in errors)

    text = "\n".join(logs_seen)
    assert "Redis unavailable" in text  # the fail-open path was logged too
    assert "goes to the dead letters" in text and "retry in" in text
    assert f"127.0.0.1:{refused_port}" in text  # scheme and host are fine
    assert _leaks(text) == [], text
    for page in metrics_seen:
        assert _leaks(page) == []
        assert f"127.0.0.1:{receiver.port}" not in page and str(refused_port) not in page
    # Nothing in the stored attempt records either.
    stored = json.dumps(await rows(database_url, "SELECT error, response_body FROM webhook_outbox"))
    assert QUERY_TOKEN not in stored and "/hook" not in stored

    if log_format == "json":
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
        failed = [r for r in records if r.get("status") == 503]
        assert failed, "no structured record of the 503"
        assert {"delivery_id", "event_type", "attempt", "duration_ms"} <= failed[0].keys()
        assert failed[0]["attempt"] == 1 and failed[0]["event_type"] == "stream.updated"
    else:
        assert "status=503" in text and "delivery_id=" in text


def test_tracebacks_and_third_party_records_are_scrubbed() -> None:
    url = f"https://consumer.example.com:8443/in/hook?token={QUERY_TOKEN}&x=1"
    logs.add_sensitive(SECRET)
    try:
        try:
            raise aiohttp.ClientResponseError(
                aiohttp.RequestInfo(
                    url=yarl.URL(url),
                    method="POST",
                    headers=CIMultiDictProxy(CIMultiDict()),
                    real_url=yarl.URL(url),
                ),
                (),
                status=500,
                message=f"server error, signed with {SECRET}",
            )
        except aiohttp.ClientResponseError:
            exc_info = sys.exc_info()
        record = logging.LogRecord(
            "aiohttp.client", logging.ERROR, __file__, 1, "request to %s failed", (url,), exc_info
        )
        record.delivery_id = "d-1"
        for formatter in (logs.JsonFormatter(), logs.TextFormatter()):
            out = formatter.format(record)
            record.exc_text = None  # each formatter renders the traceback afresh
            assert "https://consumer.example.com:8443" in out
            assert "ClientResponseError" in out  # the traceback is kept, only scrubbed
            assert _leaks(out) == [] and "/in/" not in out and "x=1" not in out, out
        conninfo = logging.LogRecord(
            "psycopg.pool",
            logging.WARNING,
            __file__,
            1,
            "connect failed: host=db port=5432 password=%s",
            (DB_PASSWORD,),
            None,
        )
        assert DB_PASSWORD not in logs.TextFormatter().format(conninfo)
    finally:
        logs.clear_sensitive()


async def test_an_uncaught_exception_is_scrubbed_too(tmp_path: Path) -> None:
    code = (
        "from fluxora_webhooks import logs\n"
        "logs.configure('text')\n"
        f"raise RuntimeError('could not reach http://h.example/hook?token={QUERY_TOKEN}')\n"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, stderr=asyncio.subprocess.PIPE
    )
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    text = err.decode()
    assert proc.returncode == 1
    assert "RuntimeError: could not reach http://h.example" in text
    assert _leaks(text) == []


async def test_json_delivery_records_name_the_endpoint_and_the_reason_and_the_breaker_too(
    database_url: str, redis_url: str, redis_prefix: str, receiver: Receiver, tmp_path: Path
) -> None:
    """A real run with JSON logs, a consumer that always answers 503 and a breaker that
    opens at the second failure: the retry's and the dead letter's records carry
    ``endpoint_id`` (and no ``tenant``: the default tenant's), the dead letter's its
    ``reason``; the breaker's line
    names the endpoint of its URL (never the URL's path or query)."""
    receiver.respond = lambda r: web.Response(status=503)
    port = next(p for p in range(47400, 47500) if _free(p))
    env = dispatcher_env(
        database_url, redis_url, receiver.url, redis_prefix,
        WEBHOOK_METRICS_PORT=str(port), LOG_FORMAT="json", WEBHOOK_MAX_ATTEMPTS="2",
        WEBHOOK_RETRY_SCHEDULE="50ms", WEBHOOK_CIRCUIT_BREAKER_THRESHOLD="2",
        WEBHOOK_POLL_INTERVAL_MS="200",
    )  # fmt: skip
    async with running_service(env, tmp_path / "run.log") as service:
        await _enqueue(database_url, ["one"])
        await wait_until(lambda: _idle(database_url), timeout=30, what="dead-lettered")

        async def opened() -> bool:
            return "opened (from closed)" in service.proc.log()

        await wait_until(opened, timeout=10, what="the breaker's line")
    text = service.proc.log()
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    retry = [r for r in records if "retry in" in r["message"]]
    dead = [r for r in records if "goes to the dead letters" in r["message"]]
    assert len(retry) == 1 and len(dead) == 1, text
    for record in (retry[0], dead[0]):
        assert record["endpoint_id"] == "default", record
        assert "tenant" not in record  # the default tenant's ('')
        assert record["status"] == 503
    assert "reason" not in retry[0]  # a retry has none
    assert dead[0]["reason"] == "attempts_exhausted"
    (breaker,) = [r for r in records if r["message"].startswith("circuit breaker for")]
    assert breaker["message"].startswith(
        f"circuit breaker for http://127.0.0.1:{receiver.port} (endpoint default) opened"
    ), breaker
    assert _leaks(text) == [], text


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


async def test_a_supervised_runs_records_say_which_worker_wrote_them(
    database_url: str, redis_url: str, redis_prefix: str, receiver: Receiver, tmp_path: Path
) -> None:
    """Two workers write to one stream: each record of a worker carries its index and pid
    (the supervisor's "worker N started (pid P)" names both), the supervisor's own none."""

    async def slow_refusal(r: Received) -> web.Response:
        await asyncio.sleep(0.05)  # 40 rows outlast one worker's four claims in flight
        return web.Response(status=503)

    receiver.respond = slow_refusal
    env = dispatcher_env(
        database_url, redis_url, receiver.url, redis_prefix,
        WEBHOOK_WORKERS="2", LOG_FORMAT="json", WEBHOOK_MAX_ATTEMPTS="1",
        WEBHOOK_POLL_INTERVAL_MS="200", WEBHOOK_BATCH_SIZE="1",
        WEBHOOK_METRICS_PORT=str(free_port()),
    )  # fmt: skip

    def records_of(service: ServiceProcess) -> list[dict[str, Any]]:
        return [json.loads(line) for line in service.proc.log().splitlines() if line.strip()]

    def workers_of_dead(records: list[dict[str, Any]]) -> set[int]:
        return {r["worker"] for r in records if "goes to the dead letters" in r["message"]}

    waves = 0
    async with running_service(env, tmp_path / "run.log") as service:
        # In waves: a worker that started late on a loaded machine finds the first wave
        # taken by the other; each wave is due while both poll.
        while waves < 10 and workers_of_dead(records_of(service)) != {0, 1}:
            await _enqueue(database_url, [f"k{waves}-{i}" for i in range(40)])
            await wait_until(lambda: _idle(database_url), timeout=30, what="dead-lettered")
            waves += 1
    records = records_of(service)
    started = {
        int(r["message"].split()[1]): int(r["message"].rsplit("pid ", 1)[1].rstrip(")"))
        for r in records
        if r["message"].startswith("worker ") and " started (pid " in r["message"]
    }
    assert sorted(started) == [0, 1], records
    dead = [r for r in records if "goes to the dead letters" in r["message"]]
    assert len(dead) == 40 * waves
    assert {r["worker"] for r in dead} == {0, 1}  # both took rows
    for record in dead:
        assert record["pid"] == started[record["worker"]], record
    supervisor = [r for r in records if r["logger"] == "fluxora_webhooks.supervisor"]
    assert supervisor and all("worker" not in r for r in supervisor)
    assert {r["pid"] for r in supervisor} == {service.proc.pid}


async def test_a_worker_that_cannot_start_says_why_in_the_runs_log_format(
    database_url: str, tmp_path: Path
) -> None:
    """A worker stops on what the supervisor did not check for it (a Redis Cluster URL
    naming a database, a schema changed in between): with JSON logs its reason is one JSON
    record with its worker index, not a plain line among the records."""
    read_fd, write_fd = os.pipe()
    env = dispatcher_env(
        database_url, "redis://127.0.0.1:1/0", "https://hooks.example.com/x", "p:",
        LOG_FORMAT="json", WEBHOOK_BATCH_SIZE="0",
        PROMETHEUS_MULTIPROC_DIR=str(tmp_path), FLUXORA_WORKER="1",
    )  # fmt: skip
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fluxora_webhooks.worker",
            "--index", "1", "--ready-fd", str(write_fd), "--supervisor", str(os.getpid()),
            env=env, pass_fds=(write_fd,),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, err = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        os.close(read_fd)
        os.close(write_fd)
    assert proc.returncode == 2, err
    (record,) = [json.loads(line) for line in err.decode().splitlines()]
    assert record["level"] == "critical" and record["worker"] == 1, record
    assert record["message"].startswith("configuration error: WEBHOOK_BATCH_SIZE: "), record
