"""Per-endpoint observability (issue 17): ``status`` shows the worst endpoints (disabled by
the dispatcher, failing longest, largest backlog) with their pending and parked deliveries,
failure streak and last error, in text and ``--json``; the per-endpoint series name at most
``METRIC_ENDPOINTS`` endpoints plus one ``_other``, and leave nothing stale behind."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import psycopg
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fluxora_webhooks import metrics
from fluxora_webhooks.ops import METRIC_ENDPOINTS, read_endpoint_health, set_endpoint_gauges
from tests.support.dispatch import wait_until
from tests.support.procs import command_env, dispatcher_env, dispatchers, free_port, run_command
from tests.support.scrape import scrape, total

pytestmark = pytest.mark.e2e

HEALTHY = [f"ep_h{i}" for i in range(10)]


async def _seed(database_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO webhook_endpoints (id, tenant, url, secret, state, disabled_reason,"
            " disabled_at, failing_since) VALUES"
            " ('ep_gone', 'acme', 'https://a.example/x?token=t1', 'whsec_x', 'disabled',"
            "  'gone', now() - interval '30 minutes', now() - interval '90 minutes'),"
            " ('ep_old', 'acme', 'https://b.example/', 'whsec_x', 'enabled', NULL, NULL,"
            "  now() - interval '2 hours'),"
            " ('ep_new', 'bolt', 'https://c.example/', 'whsec_x', 'enabled', NULL, NULL,"
            "  now() - interval '1 minute'),"
            " ('ep_big', 'bolt', 'https://d.example/', 'whsec_x', 'enabled', NULL, NULL, NULL),"
            " ('ep_manual', 'bolt', 'https://e.example/', 'whsec_x', 'disabled', 'manual',"
            "  now(), NULL)"
        )
        await conn.execute(
            "INSERT INTO webhook_endpoints (id, tenant, url, secret)"
            " SELECT id, 'many', 'https://f.example/', 'whsec_x' FROM unnest(%s::text[]) id",
            (HEALTHY,),
        )

        async def pending(endpoint: str, n: int, hold: str | None = None, attempt: int = 1) -> None:
            await conn.execute(
                "INSERT INTO webhook_outbox (stream_id, event_type, payload, endpoint_id, hold,"
                " attempt, created_at)"
                " SELECT 's' || g, 'e', '{}', %s, %s, %s,"
                "   CASE WHEN %s::text IS NULL THEN now() + interval '1 hour'"
                "   ELSE 'infinity' END FROM generate_series(1, %s) g",
                (endpoint, hold, attempt, hold, n),
            )

        # ep_gone's last failure, the 410 that disabled it: its retry row parked, then
        # 250 more parked deliveries (newer than the retry row: the first way of finding a
        # last failure, the newest 200 pending rows, does not reach it).
        await conn.execute(
            "WITH failed AS ("
            " INSERT INTO webhook_outbox (stream_id, event_type, payload, endpoint_id,"
            "  processed, processed_at, outcome, status_code, error)"
            " SELECT 'g', 'e', '{}', 'ep_gone', true, disabled_at - interval '200 ms', 'retry',"
            "  410, 'HTTP 410' FROM webhook_endpoints WHERE id = 'ep_gone'"
            " RETURNING delivery_id)"
            " INSERT INTO webhook_outbox (stream_id, event_type, payload, endpoint_id,"
            "  delivery_id, attempt, hold, created_at)"
            " SELECT 'g', 'e', '{}', 'ep_gone', delivery_id, 2, 'parked', 'infinity'"
            " FROM failed"
        )
        await pending("ep_gone", 250, "parked")
        await pending("ep_old", 4)
        await pending("ep_big", 30)
        for i, endpoint in enumerate(HEALTHY):
            await pending(endpoint, 10 - i)  # ep_h0 has the most
        # ep_old's last failure: attempt 1 failed with a 503, attempt 2 waits.
        await conn.execute(
            "WITH failed AS ("
            " INSERT INTO webhook_outbox (stream_id, event_type, payload, endpoint_id,"
            "  processed, processed_at, outcome, status_code, error)"
            " VALUES ('r', 'e', '{}', 'ep_old', true, now() - interval '5 minutes', 'retry',"
            "  503, 'HTTP 503') RETURNING delivery_id)"
            " INSERT INTO webhook_outbox (stream_id, event_type, payload, endpoint_id,"
            "  delivery_id, attempt, created_at)"
            " SELECT 'r', 'e', '{}', 'ep_old', delivery_id, 2, now() + interval '1 hour'"
            " FROM failed"
        )
        # ep_new's: a dead letter.
        await conn.execute(
            "INSERT INTO webhook_dead_letter (delivery_id, stream_id, event_type, payload,"
            " attempts, reason, last_error, enqueued_at, endpoint_id, tenant)"
            " VALUES (gen_random_uuid(), 'd', 'e', '{}', 8, 'attempts_exhausted', 'timeout',"
            "  now(), 'ep_new', 'bolt')"
        )


async def test_status_shows_the_worst_endpoints_in_text_and_json(database_url: str) -> None:
    await _seed(database_url)
    env = command_env(DATABASE_URL=database_url)
    code, out = await run_command("status", "--json", "--endpoints", "5", env=env)
    assert code == 0, out
    endpoints = json.loads(out)["endpoints"]
    assert endpoints["total"] == 5 + len(HEALTHY)
    assert endpoints["disabled"] == 2 and endpoints["failing"] == 2
    assert endpoints["pending"] == 251 + 5 + 30 + sum(range(1, 11))
    worst = endpoints["worst"]
    assert [e["id"] for e in worst] == ["ep_gone", "ep_old", "ep_new", "ep_big", "ep_h0"]
    gone, old, new, big, _ = worst
    assert gone["state"] == "disabled" and gone["disabled_reason"] == "gone"
    assert gone["pending"] == 251 and gone["parked"] == 251 and gone["tenant"] == "acme"
    assert gone["last_error"]["status_code"] == 410, gone
    # Its failure streak ended when it was disabled: an hour, not still growing.
    assert 3595 <= gone["failing_for_seconds"] <= 3605, gone
    assert old["failing_for_seconds"] > 7000 and old["pending"] == 5 and old["parked"] == 0
    assert old["last_error"]["status_code"] == 503 and old["last_error"]["error"] == "HTTP 503"
    assert 30 <= new["failing_for_seconds"] < 600
    assert new["last_error"]["error"] == "timeout" and new["last_error"]["status_code"] is None
    assert big["pending"] == 30 and big["failing_for_seconds"] is None
    assert big["last_error"] is None and big["state"] == "enabled"

    code, text = await run_command("status", env=env)
    assert code == 0, text
    assert "Worst endpoints" in text and "disabled (gone)" in text
    assert "HTTP 503" in text and "timeout" in text and "2h 00m" in text
    assert "token=t1" not in text and "a.example" not in text  # never a URL
    assert "ep_manual" not in text  # the eleventh worst: not among the default ten
    code, text = await run_command("status", "--endpoints", "0", env=env)
    assert code == 0 and "Worst endpoints" not in text and "Endpoints: 15" in text
    code, text = await run_command("status", "--endpoints", "1001", env=env)
    assert code == 2 and "--endpoints" in text


def _samples(name: str) -> dict[str, float]:
    text = generate_latest(metrics.REGISTRY).decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                out[sample.labels.get("endpoint") or sample.labels["state"]] = sample.value
    return out


async def test_per_endpoint_series_are_bounded_and_never_stale(database_url: str) -> None:
    await _seed(database_url)
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        set_endpoint_gauges(await read_endpoint_health(conn, METRIC_ENDPOINTS))
        pending = _samples("fluxora_webhook_endpoint_pending")
        assert len(pending) == METRIC_ENDPOINTS + 1  # 15 endpoints: 10 named, one _other
        named = ["ep_gone", "ep_old", "ep_new", "ep_big", *HEALTHY[:6]]
        assert set(pending) == {*named, metrics.OTHER_ENDPOINTS}
        assert pending["ep_big"] == 30 and pending["ep_gone"] == 251
        # The others: ep_h6..ep_h9 (4, 3, 2, 1 pending) and ep_manual (none).
        assert pending[metrics.OTHER_ENDPOINTS] == 4 + 3 + 2 + 1
        failing = _samples("fluxora_webhook_endpoint_failing_seconds")
        assert set(failing) == set(named) and failing["ep_old"] > 7000 and failing["ep_big"] == 0
        assert _samples("fluxora_webhook_endpoint_disabled")["ep_gone"] == 1
        states = _samples("fluxora_webhook_endpoints")
        assert states == {"enabled": 13, "disabled": 2, "failing": 2}

        # ep_gone is enabled again and its deliveries go: it leaves the named series.
        await conn.execute(
            "UPDATE webhook_endpoints SET state = 'enabled', disabled_reason = NULL,"
            " disabled_at = NULL, failing_since = NULL WHERE id = 'ep_gone'"
        )
        await conn.execute("DELETE FROM webhook_outbox WHERE endpoint_id = 'ep_gone'")
        set_endpoint_gauges(await read_endpoint_health(conn, METRIC_ENDPOINTS))
    pending = _samples("fluxora_webhook_endpoint_pending")
    assert "ep_gone" not in pending and "ep_h6" in pending
    assert len(pending) == METRIC_ENDPOINTS + 1
    assert "ep_gone" not in _samples("fluxora_webhook_endpoint_failing_seconds")


async def test_a_running_service_serves_the_bounded_per_endpoint_series(
    database_url: str, redis_url: str, redis_prefix: str, tmp_path: Path
) -> None:
    await _seed(database_url)
    port = free_port()
    env = dispatcher_env(
        database_url, redis_url, "http://127.0.0.1:9/unused", redis_prefix,
        WEBHOOK_METRICS_PORT=str(port),
    )  # fmt: skip
    async with dispatchers(1, env, tmp_path) as (service,):

        async def read() -> bool:
            try:
                samples = await scrape(port)
            except (aiohttp.ClientError, OSError):
                return False
            found = {
                dict(labels)["endpoint"]: value
                for (name, labels), value in samples.items()
                if name == "fluxora_webhook_endpoint_pending"
            }
            if not found:
                return False
            assert len(found) == METRIC_ENDPOINTS + 1, found
            assert found["ep_big"] == 30 and found[metrics.OTHER_ENDPOINTS] == 10
            disabled = total(samples, "fluxora_webhook_endpoints", state="disabled")
            assert disabled == 2
            return True

        await wait_until(read, timeout=30, what=f"the per-endpoint series\n{service.log()}")
