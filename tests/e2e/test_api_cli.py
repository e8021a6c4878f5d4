"""The API's commands as an operator runs them: ``tokens create|list|revoke`` (printed
once, never listed), ``fluxora-webhooks api`` on WEBHOOK_API_PORT, and ``run`` serving the
API beside its workers when WEBHOOK_API_PORT is set; each stops cleanly on SIGTERM, and no
token reaches their logs."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import aiohttp
import psycopg
import pytest

from tests.support.dispatch import scalar, wait_until
from tests.support.procs import (
    command_env,
    dispatcher_env,
    free_port,
    run_command,
    start_dispatcher,
)

pytestmark = pytest.mark.e2e


async def wait_for_api(url: str, token: str, timeout: float = 30) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.get(
                    url + "/api/v1/stats", headers={"Authorization": f"Bearer {token}"}
                ) as resp:
                    assert resp.status == 200, await resp.text()
                    body: dict[str, object] = await resp.json()
                    return body
            except aiohttp.ClientConnectionError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)


async def scrape(port: int) -> str:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}/metrics") as resp,
    ):
        assert resp.status == 200
        return await resp.text()


def api_requests(text: str, route: str, status: int) -> float:
    """fluxora_api_requests_total's value for GET ``route`` answered ``status`` (0: none)."""
    sample = f'fluxora_api_requests_total{{method="GET",route="{route}",status="{status}"}} '
    found = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(sample)]
    assert len(found) <= 1, text
    return found[0] if found else 0.0


async def test_tokens_create_list_revoke(database_url: str) -> None:
    env = command_env(DATABASE_URL=database_url)
    code, out = await run_command("tokens", "create", "--name", "ops", "--json", env=env)
    assert code == 0, out
    made = json.loads(out)
    assert made["name"] == "ops" and made["token"].startswith("fxa_") and made["tenant"] is None
    code, out = await run_command(
        "tokens", "create", "--name", "portal", "--tenant", "", "--read-only", "--json", env=env
    )
    assert code == 0 and json.loads(out)["tenant"] == "" and json.loads(out)["read_only"]
    portal = json.loads(out)["token"]
    code, out = await run_command("tokens", "create", "--name", "ops", env=env)
    assert code == 1 and "exists already" in out
    for args in (("tokens", "list"), ("tokens", "list", "--json")):
        code, out = await run_command(*args, env=env)
        assert code == 0 and "ops" in out and "portal" in out
        assert made["token"] not in out and portal not in out and "token_hash" not in out
    code, out = await run_command("tokens", "revoke", "ops", env=env)
    assert code == 0 and "revoked ops" in out
    code, out = await run_command("tokens", "revoke", "ops", env=env)
    assert code == 1 and "revoked already" in out
    code, out = await run_command("tokens", "revoke", "nobody", env=env)
    assert code == 1 and "no token named" in out
    code, out = await run_command("tokens", "create", "--name", "bad name", env=env)
    assert code == 2 and "--name" in out


def with_plain_parameters(url: str) -> str:
    """``url`` with connection parameters that are no secret: the logs must not mask them
    (``disable`` and ``fluxora`` are words of the logs' own lines)."""
    if "://" in url:
        return url + ("&" if "?" in url else "?") + "application_name=fluxora&sslmode=disable"
    return url + " application_name=fluxora sslmode=disable"


async def test_the_api_command_serves_and_stops_on_sigterm(
    database_url: str, tmp_path: Path
) -> None:
    env = command_env(DATABASE_URL=with_plain_parameters(database_url))
    code, out = await run_command("tokens", "create", "--name", "ops", "--json", env=env)
    assert code == 0, out
    token = json.loads(out)["token"]
    port, metrics_port = free_port(), free_port()
    log = tmp_path / "api.log"
    with log.open("wb") as sink:
        proc = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "fluxora_webhooks", "api"),
            env={**env, "WEBHOOK_API_PORT": str(port), "WEBHOOK_METRICS_PORT": str(metrics_port)},
            stdout=sink,
            stderr=asyncio.subprocess.STDOUT,
        )
    try:
        stats = await wait_for_api(f"http://127.0.0.1:{port}", token)
        assert stats["redis"] == {
            "configured": False,
            "reachable": False,
            "error": "REDIS_URL is not set",
        }
        # Its requests on WEBHOOK_METRICS_PORT, set here; no dispatcher's series (it has
        # none), and nothing on its own port, which says nothing without a token.
        text = await scrape(metrics_port)
        assert api_requests(text, "/api/v1/stats", 200) == 1, text
        assert "fluxora_api_request_duration_seconds_bucket" in text
        assert "fluxora_webhook_deliveries" not in text and token not in text
        # Its own build series: not the dispatchers', whose absence the
        # FluxoraWebhooksAbsent alert watches (an API scraped beside them silenced it).
        assert 'fluxora_api_build_info{version="' in text, text
        assert "fluxora_webhook_" not in text, text
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{port}/metrics") as resp,
        ):
            assert resp.status == 404
    finally:
        proc.terminate()
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    text = log.read_text()
    assert f"serving on http://127.0.0.1:{port}/" in text
    assert "fluxora_webhooks.api" in text and "***" not in text  # nothing was a secret
    assert token not in text


async def test_a_second_signal_stops_the_api_command_with_a_request_in_flight(
    database_url: str, tmp_path: Path
) -> None:
    """The first SIGTERM lets requests in flight finish (bounded); a second one cuts them off
    at once, as it does for ``run``."""
    env = command_env(DATABASE_URL=database_url)
    code, out = await run_command("tokens", "create", "--name", "ops", "--json", env=env)
    assert code == 0, out
    token = json.loads(out)["token"]
    port = free_port()
    log = tmp_path / "api.log"
    with log.open("wb") as sink:
        proc = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "fluxora_webhooks", "api"),
            env={**env, "WEBHOOK_API_PORT": str(port)},
            stdout=sink,
            stderr=asyncio.subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as session:
        try:
            await wait_for_api(url, token)
            async with await psycopg.AsyncConnection.connect(database_url) as blocker:
                # An operator's long transaction: the endpoints list waits for its lock.
                await blocker.execute("LOCK TABLE webhook_endpoints IN ACCESS EXCLUSIVE MODE")
                listing = asyncio.ensure_future(
                    session.get(
                        url + "/api/v1/endpoints", headers={"Authorization": f"Bearer {token}"}
                    )
                )

                async def list_waits() -> bool:
                    waiting: int = await scalar(
                        database_url,
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                        " AND datname = current_database() AND query LIKE '%webhook_endpoints%'",
                    )
                    return waiting == 1

                await wait_until(list_waits, timeout=20, what="the list waiting for its lock")
                proc.terminate()

                async def stopping() -> bool:
                    return "stopping on SIGTERM" in log.read_text()

                await wait_until(stopping, timeout=20, what="the first signal's line")
                proc.terminate()
                code = await asyncio.wait_for(proc.wait(), 15)
                # It stopped while the request still waited for the lock: cut off.
                assert await list_waits() is False  # its session went with the process
                assert not blocker.closed and blocker.info.transaction_status.name == "INTRANS"
            try:  # not the list: an error, or no answer at all
                resp = await asyncio.wait_for(listing, 10)
                assert resp.status >= 500, await resp.text()
            except aiohttp.ClientError:
                pass
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert code == 0, log.read_text()
    text = log.read_text()
    assert "finishing the requests in flight" in text
    assert "requests still in flight (a second signal)" in text, text


async def test_run_serves_the_api_beside_its_workers(
    database_url: str, redis_url: str, redis_prefix: str, tmp_path: Path
) -> None:
    code, out = await run_command(
        "tokens", "create", "--name", "ops", "--json", env=command_env(DATABASE_URL=database_url)
    )
    assert code == 0, out
    token = json.loads(out)["token"]
    port, metrics_port = free_port(), free_port()
    env = dispatcher_env(
        with_plain_parameters(database_url),
        redis_url,
        "http://127.0.0.1:9/unused",
        redis_prefix,
        WEBHOOK_WORKERS="2",
        WEBHOOK_API_PORT=str(port),
        WEBHOOK_METRICS_PORT=str(metrics_port),
    )
    proc = await start_dispatcher(env, tmp_path / "run.log")
    try:
        stats = await wait_for_api(f"http://127.0.0.1:{port}", token)
        assert stats["redis"] == {"configured": True, "reachable": True, "error": None}
        # The API's series on the run's metrics port, once (the supervisor serves the
        # API; the workers' files hold none of them), beside the dispatchers'.
        text = await scrape(metrics_port)
        assert text.count("# HELP fluxora_api_requests_total ") == 1, text
        assert api_requests(text, "/api/v1/stats", 200) == 1, text
        assert "fluxora_webhook_workers" in text
    finally:
        started = time.monotonic()
        proc.terminate()
        assert await proc.wait(30) == 0, proc.log()
    assert time.monotonic() - started < 15
    assert "management API and dashboard on" in proc.log()
    assert "fluxora_webhooks.supervisor: worker 0 started" in proc.log()
    assert token not in proc.log()
