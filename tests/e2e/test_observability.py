"""Operating it: a real ``fluxora-webhooks run`` process, its /metrics after deliveries,
retries, dead letters and a breaker trip, and its health endpoints."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import psycopg
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from fluxora_webhooks.migrations import latest_version
from fluxora_webhooks.ops import read_backlog
from tests.support.dispatch import SECRET, pending, rows, wait_until
from tests.support.procs import (
    DispatcherProcess,
    dispatcher_env,
    free_port,
    start_dispatcher,
)
from tests.support.receiver import Received, Receiver

pytestmark = pytest.mark.e2e

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@asynccontextmanager
async def running_service(env: dict[str, str], log_path: Path) -> AsyncIterator[ServiceProcess]:
    proc = await start_dispatcher(env, log_path)
    service = ServiceProcess(proc, int(env["WEBHOOK_METRICS_PORT"]))
    try:
        await service.wait_healthy()
        yield service
    finally:
        proc.terminate()
        try:
            code = await proc.wait(30)
        except TimeoutError:
            proc.kill()
            await proc.wait(10)
            raise
        assert code == 0, proc.log()


class ServiceProcess:
    """A service process and its HTTP endpoint."""

    def __init__(self, proc: DispatcherProcess, port: int) -> None:
        self.proc = proc
        self.base = f"http://127.0.0.1:{port}"

    async def get(self, path: str) -> tuple[int, str]:
        async with (
            aiohttp.ClientSession() as session,
            session.get(self.base + path, timeout=aiohttp.ClientTimeout(total=10)) as resp,
        ):
            return resp.status, await resp.text()

    async def wait_healthy(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.proc.returncode is not None:
                raise AssertionError(f"the service exited early:\n{self.proc.log()}")
            try:
                if (await self.get("/healthz"))[0] == 200:
                    return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"no /healthz within {timeout}s:\n{self.proc.log()}")
            await asyncio.sleep(0.1)

    async def metrics_text(self) -> str:
        status, text = await self.get("/metrics")
        assert status == 200
        return text

    async def samples(self) -> Samples:
        return parse_samples(await self.metrics_text())

    async def wait_for_sample(
        self, name: str, labels: dict[str, str], value: float, timeout: float = 20
    ) -> Samples:
        found: Samples = {}

        async def reached() -> bool:
            nonlocal found
            found = await self.samples()
            return sample(found, name, **labels) == value

        await wait_until(reached, timeout=timeout, what=f"{name}{labels} == {value}")
        return found

    async def wait_for_refresh_after(self, moment: float, timeout: float = 20) -> Samples:
        """The samples once the backlog gauges were read after ``moment``."""
        found: Samples = {}

        async def refreshed() -> bool:
            nonlocal found
            found = await self.samples()
            return sample(found, "fluxora_webhook_backlog_refreshed_timestamp_seconds") > moment

        await wait_until(refreshed, timeout=timeout, what="a backlog refresh")
        return found


def parse_samples(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def sample(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


async def _enqueue_kinds(database_url: str, kinds: list[str]) -> None:
    """One statement, so the rows are due together and claimed in this order."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload)"
            " SELECT 's-' || n, 'stream.updated', jsonb_build_object('kind', k, 'n', n)"
            " FROM unnest(%s::text[]) WITH ORDINALITY AS t(k, n) ORDER BY n",
            (kinds,),
        )


def _kind(r: Received) -> str:
    return str(json.loads(r.body)["kind"])


@pytest.mark.slow
async def test_metrics_after_deliveries_retries_dead_letters_and_a_breaker_trip(
    database_url: str, redis_url: str, redis_prefix: str, receiver: Receiver, tmp_path: Path
) -> None:
    def respond(r: Received) -> web.Response:
        kind = _kind(r)
        if kind == "gone":
            return web.Response(status=410)
        if kind == "exhausted" or (kind == "flaky" and r.attempt == 1):
            return web.Response(status=503)
        if kind == "down":
            downs = sum(1 for x in receiver.received if _kind(x) == "down")
            return web.Response(status=503 if downs <= 3 else 200)
        return web.Response(status=200)

    receiver.respond = respond
    port = free_port()
    env = dispatcher_env(
        database_url,
        redis_url,
        receiver.url,
        redis_prefix,
        WEBHOOK_METRICS_PORT=str(port),
        WEBHOOK_CLAIM_LOOPS="1",
        WEBHOOK_BATCH_SIZE="10",
        WEBHOOK_POLL_INTERVAL_MS="200",
        WEBHOOK_MAX_ATTEMPTS="2",
        WEBHOOK_RETRY_SCHEDULE="50ms",
        WEBHOOK_RETRY_RPS="1",
        WEBHOOK_CIRCUIT_BREAKER_THRESHOLD="3",
        WEBHOOK_CIRCUIT_BREAKER_RESET_MS="1500",
    )
    async with running_service(env, tmp_path / "service.log") as service:
        first = await service.samples()
        # Every series is there from the first scrape, at zero.
        assert sample(first, "fluxora_webhook_deliveries_total", outcome="delivered") == 0
        assert (
            "fluxora_webhook_circuit_breaker_transitions_total",
            frozenset({("from_state", "closed"), ("to_state", "open")}),
        ) in first

        # Phase 1: two failures in a row at most (the deliveries after them reset the
        # breaker's count), a retry that succeeds, a retry that runs out, two 410s; the
        # retries queue behind the rate limit (1 retry per second).
        await _enqueue_kinds(
            database_url, ["flaky", "exhausted", "gone", "gone", "ok", "ok", "ok", "ok", "ok"]
        )
        await wait_until(lambda: _idle(database_url), timeout=30, what="phase 1 done")
        # Phase 2: the consumer fails three first attempts: the breaker opens, the retries
        # wait for the reset, one probe succeeds and the breaker closes.
        await _enqueue_kinds(database_url, ["down", "down", "down"])
        await wait_until(lambda: _idle(database_url), timeout=60, what="phase 2 done")
        found = await service.wait_for_refresh_after(time.time())
        text = await service.metrics_text()

    def total(name: str, **labels: str) -> float:
        return sample(found, name, **labels)

    deliveries = "fluxora_webhook_deliveries_total"
    assert total(deliveries, outcome="delivered") == 9
    assert total(deliveries, outcome="retry") == 5
    assert total(deliveries, outcome="dead_letter") == 3
    rate_limited = total("fluxora_webhook_rate_limit_deferrals_total")
    circuit_open = total("fluxora_webhook_circuit_open_deferrals_total")
    assert rate_limited >= 1 and circuit_open >= 1
    assert total(deliveries, outcome="deferred") == rate_limited + circuit_open
    assert total("fluxora_webhook_dead_letters_total", reason="http_4xx") == 2
    assert total("fluxora_webhook_dead_letters_total", reason="attempts_exhausted") == 1
    # 17 HTTP attempts; 12 deliveries ended (9 delivered, 3 dead-lettered) after 17 attempts.
    assert total("fluxora_webhook_attempt_duration_seconds_count") == 17
    assert total("fluxora_webhook_attempts_per_delivery_count") == 12
    assert total("fluxora_webhook_attempts_per_delivery_sum") == 17
    assert total("fluxora_webhook_attempts_per_delivery_bucket", le="1.0") == 7
    transitions = "fluxora_webhook_circuit_breaker_transitions_total"
    assert total(transitions, from_state="closed", to_state="open") == 1
    assert total(transitions, from_state="open", to_state="half-open") == 1
    assert total(transitions, from_state="half-open", to_state="closed") == 1
    assert total(transitions, from_state="half-open", to_state="open") == 0
    for component in ("gate", "ratelimit", "breaker"):
        assert total("fluxora_webhook_redis_fail_open_total", component=component) == 0
    assert total("fluxora_webhook_in_flight_requests") == 0
    assert total("fluxora_webhook_dead_letter_rows") == 3
    assert total("fluxora_webhook_outbox_pending") == 0
    assert total("fluxora_webhook_outbox_due") == 0
    assert total("fluxora_webhook_outbox_oldest_due_age_seconds") == 0
    assert total("fluxora_webhook_outbox_pending_estimated") == 0
    assert total("fluxora_webhook_backlog_refreshed_timestamp_seconds") > time.time() - 60
    assert total("fluxora_webhook_circuit_breaker_state", state="closed") == 1
    assert total("fluxora_webhook_circuit_breaker_state", state="open") == 0

    # The database agrees.
    assert await rows(
        database_url,
        "SELECT outcome, count(*) FROM webhook_outbox GROUP BY outcome ORDER BY outcome",
    ) == [("dead_letter", 3), ("delivered", 9), ("retry", 5)]

    # Prometheus conventions: counters end in _total (and no *_created gauge families of
    # their creation times); no URL or secret anywhere.
    for family in text_string_to_metric_families(text):
        if family.type == "counter":
            assert all(s.name.endswith("_total") for s in family.samples)
    assert "_created" not in text
    for leak in (SECRET.decode(), "sekrit-query-token", "/hook", f"127.0.0.1:{receiver.port}"):
        assert leak not in text


async def _idle(database_url: str) -> bool:
    return await pending(database_url) == 0


async def test_health_in_flight_and_readiness_follows_the_schema(
    database_url: str, redis_url: str, redis_prefix: str, receiver: Receiver, tmp_path: Path
) -> None:
    release = asyncio.Event()

    async def hold(r: Received) -> web.Response:
        await release.wait()
        return web.Response(status=200)

    receiver.respond = hold
    env = dispatcher_env(
        database_url,
        redis_url,
        receiver.url,
        redis_prefix,
        WEBHOOK_METRICS_PORT=str(free_port()),
        WEBHOOK_CLAIM_LOOPS="1",
        WEBHOOK_TIMEOUT_MS="20000",
    )
    async with running_service(env, tmp_path / "service.log") as service:
        status, body = await service.get("/healthz")
        assert status == 200 and json.loads(body)["status"] == "ok"

        async def ready() -> bool:  # "starting" until it dispatches
            status, body = await service.get("/readyz")
            return status == 200 and json.loads(body)["status"] == "ready"

        await wait_until(ready, timeout=30, what="/readyz ready")

        await _enqueue_kinds(database_url, ["ok", "ok", "ok"])
        await receiver.wait_for(3, timeout=20)
        # Shown once their batch has let them go on without it (at most PATIENCE_S).
        await service.wait_for_sample("fluxora_webhook_in_flight_requests", {}, 3, timeout=5)
        release.set()
        await wait_until(lambda: _idle(database_url), what="delivered")
        await service.wait_for_sample("fluxora_webhook_in_flight_requests", {}, 0)

        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            # A newer schema (another version migrated the database): not ready.
            await conn.execute(
                "INSERT INTO fluxora_schema_migrations (version, name, checksum)"
                " VALUES (%s, 'from_the_future', 'x')",
                (latest_version() + 1,),
            )
            status, body = await service.get("/readyz")
            assert status == 503, body
            assert "newer" in json.loads(body)["reason"]
            await conn.execute(
                "DELETE FROM fluxora_schema_migrations WHERE version = %s",
                (latest_version() + 1,),
            )
            status, _ = await service.get("/readyz")
            assert status == 200
            # An older schema: not ready either, and it says what to run.
            saved = await (
                await conn.execute(
                    "SELECT version, name, checksum FROM fluxora_schema_migrations"
                    " WHERE version = %s",
                    (latest_version(),),
                )
            ).fetchone()
            await conn.execute(
                "DELETE FROM fluxora_schema_migrations WHERE version = %s", (latest_version(),)
            )
            status, body = await service.get("/readyz")
            assert status == 503 and "fluxora-webhooks migrate" in json.loads(body)["reason"]
            await conn.execute(
                "INSERT INTO fluxora_schema_migrations (version, name, checksum)"
                " VALUES (%s, %s, %s)",
                saved,
            )
            status, _ = await service.get("/readyz")
            assert status == 200
            # Liveness does not depend on the database.
            assert (await service.get("/healthz"))[0] == 200
    assert "Traceback" not in service.proc.log()


async def test_redis_down_fails_open_and_is_counted(
    database_url: str, redis_prefix: str, receiver: Receiver, tmp_path: Path
) -> None:
    env = dispatcher_env(
        database_url,
        "redis://127.0.0.1:1/0",  # nothing listens there
        receiver.url,
        redis_prefix,
        WEBHOOK_METRICS_PORT=str(free_port()),
        WEBHOOK_CIRCUIT_BREAKER_THRESHOLD="3",
    )
    async with running_service(env, tmp_path / "service.log") as service:
        await _enqueue_kinds(database_url, ["ok"] * 5)
        await receiver.wait_for(5, timeout=20)
        found = await service.wait_for_sample(
            "fluxora_webhook_deliveries_total", {"outcome": "delivered"}, 5
        )
    assert sample(found, "fluxora_webhook_redis_fail_open_total", component="gate") >= 1
    # The breaker's state cannot be read: no state is claimed.
    for state in ("closed", "open", "half-open"):
        assert sample(found, "fluxora_webhook_circuit_breaker_state", state=state) == 0
    assert service.proc.log().count("Redis unavailable") == 1


async def test_the_breaker_gauge_is_the_webhook_url_consumers_only(
    database_url: str, redis_url: str, redis_prefix: str, receiver: Receiver, tmp_path: Path
) -> None:
    """Without WEBHOOK_URL there is no consumer for the state gauge to read: no state is
    claimed (it said "closed" for ever, whatever registered endpoints' breakers did)."""
    env = dispatcher_env(
        database_url,
        redis_url,
        receiver.url,
        redis_prefix,
        WEBHOOK_METRICS_PORT=str(free_port()),
        WEBHOOK_CIRCUIT_BREAKER_THRESHOLD="3",
    )
    del env["WEBHOOK_URL"], env["WEBHOOK_SECRET"]
    async with running_service(env, tmp_path / "service.log") as service:

        async def ready() -> bool:
            return (await service.get("/readyz"))[0] == 200

        await wait_until(ready, timeout=30, what="ready")
        await asyncio.sleep(1.5)  # the first gauge refresh (the backlog, then the breaker)
        found = await service.samples()
    assert "fluxora_webhook_outbox_oldest_due_age_seconds" in {n for n, _ in found}  # read
    for state in ("closed", "open", "half-open"):
        assert sample(found, "fluxora_webhook_circuit_breaker_state", state=state) == 0


@pytest.mark.integration
async def test_backlog_reading_is_capped(database_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload, created_at)"
            " SELECT 's' || g, 'e', '{}'::jsonb,"
            "   CASE WHEN g <= 30 THEN now() - interval '90 seconds'"
            "   ELSE now() + interval '1 hour' END"
            " FROM generate_series(1, 50) g"
        )
        await conn.execute(
            "INSERT INTO webhook_dead_letter (delivery_id, stream_id, event_type, payload,"
            " attempts, reason, enqueued_at, state)"
            " SELECT gen_random_uuid(), 's', 'e', '{}'::jsonb, 1, 'http_4xx', now(), s"
            " FROM unnest(ARRAY['dead', 'dead', 'purged']) s"
        )
        exact = await read_backlog(conn, cap=1000)
        assert (exact.pending, exact.due, exact.dead_letters, exact.capped) == (50, 30, 2, False)
        assert 89 <= exact.oldest_due_age_s < 150
        assert exact.next_due_in_s is not None and 3500 < exact.next_due_in_s <= 3600
        capped = await read_backlog(conn, cap=10)
        assert capped.capped and capped.due == 10 and capped.pending >= 10
        await conn.execute("ANALYZE webhook_outbox")
        estimated = await read_backlog(conn, cap=10)
        assert estimated.capped and estimated.pending == 50  # the statistics' count


def test_every_series_the_docs_name_exists() -> None:
    """The operations guide, the alert rules and the dashboard name only real series."""
    from fluxora_webhooks.metrics import ENDPOINTS_COLLECTOR, REGISTRY, EndpointReading

    # The per-endpoint series exist once the endpoints' health has been read.
    ENDPOINTS_COLLECTOR.update(
        [EndpointReading("ep_x", "", 1, 0.0, False)],
        total_pending=1, endpoints=1, disabled=0, failing=0,
    )  # fmt: skip
    families = list(REGISTRY.collect())
    exposed = {s.name for family in families for s in family.samples}
    exposed |= {f.name for f in families if f.type == "histogram"}  # named as a whole
    docs = Path(__file__).resolve().parents[2] / "docs"
    for name in ("operations.md", "prometheus-alerts.yml", "grafana-dashboard.json"):
        text = (docs / name).read_text()
        named = set(re.findall(r"fluxora_webhook_[a-z_]+[a-z]", text))
        assert named, name
        assert named <= exposed, (name, sorted(named - exposed))
    json.loads((docs / "grafana-dashboard.json").read_text())
