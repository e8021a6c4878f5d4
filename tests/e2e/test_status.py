"""``fluxora-webhooks status`` and ``fluxora-webhooks prune`` as an operator runs them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from redis.asyncio import Redis

from fluxora_webhooks.redis_gate import breaker_key, rate_limit_key
from tests.support.dispatch import rows, scalar
from tests.support.procs import command_env, run_command

pytestmark = pytest.mark.e2e

CONSUMER = "https://consumer.example/in/hook?token=status-query-token"


@pytest.fixture
async def redis_client(redis_url: str, redis_prefix: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    keys = [k async for k in client.scan_iter(match=f"{redis_prefix}*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


async def _seed(database_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        # Pending: 4 due for two minutes, 3 due in an hour.
        await conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload, created_at)"
            " SELECT 'p' || g, 'e', '{}'::jsonb, CASE WHEN g <= 4"
            "   THEN now() - interval '2 minutes' ELSE now() + interval '1 hour' END"
            " FROM generate_series(1, 7) g"
        )
        # Attempts: 5 delivered, 2 retried, 1 dead-lettered in the last minutes; 7
        # delivered two hours ago.
        await conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload, created_at, processed,"
            " processed_at, outcome, status_code, duration_ms)"
            " SELECT 'h' || g, 'e', '{}'::jsonb, now() - interval '3 hours', true,"
            "   now() - (CASE WHEN o = 'old' THEN interval '2 hours' ELSE interval '1 minute' END),"
            "   CASE WHEN o = 'old' THEN 'delivered' ELSE o END, 200, 10 * g"
            " FROM (SELECT g, CASE WHEN g <= 5 THEN 'delivered' WHEN g <= 7 THEN 'retry'"
            "   WHEN g = 8 THEN 'dead_letter' ELSE 'old' END AS o"
            "   FROM generate_series(1, 15) g) s"
        )
        await conn.execute(
            "INSERT INTO webhook_dead_letter (delivery_id, stream_id, event_type, payload,"
            " attempts, reason, enqueued_at, state)"
            " SELECT gen_random_uuid(), 'd', 'e', '{}'::jsonb, 8, 'attempts_exhausted', now(), s"
            " FROM unnest(ARRAY['dead', 'dead', 'purged']) s"
        )


async def _open_breaker(client: Redis, prefix: str) -> None:
    seconds, micros = await client.time()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    await client.hset(
        breaker_key(CONSUMER, prefix),
        mapping={"state": "open", "failures": 3, "reset_at": now_ms + 60_000, "probe": ""},
    )
    # Two attempts in the window (scored ahead, so they stay in it however slowly the
    # command starts) and one long gone.
    await client.zadd(
        rate_limit_key(CONSUMER, prefix),
        {"a:1": now_ms + 60_000, "a:2": now_ms + 60_010, "a:0": now_ms - 5_000},
    )


def _env(database_url: str, tmp_path: Path, **extra: str) -> dict[str, str]:
    return command_env(DATABASE_URL=database_url, FLUXORA_HOME=str(tmp_path / "home"), **extra)


async def test_status_shows_backlog_recent_outcomes_and_the_breaker(
    database_url: str, redis_url: str, redis_prefix: str, redis_client: Redis, tmp_path: Path
) -> None:
    await _seed(database_url)
    await _open_breaker(redis_client, redis_prefix)
    env = _env(
        database_url,
        tmp_path,
        REDIS_URL=redis_url,
        WEBHOOK_URL=CONSUMER,
        FLUXORA_REDIS_PREFIX=redis_prefix,
        WEBHOOK_CIRCUIT_BREAKER_THRESHOLD="3",
    )
    code, out = await run_command("status", "--json", env=env)
    assert code == 0, out
    status: dict[str, Any] = json.loads(out)
    backlog = status["backlog"]
    assert (backlog["pending"], backlog["due_now"], backlog["estimated"]) == (7, 4, False)
    assert backlog["egress_held"] == 0
    assert 115 <= backlog["oldest_due_age_seconds"] < 300
    assert 3000 < backlog["next_due_in_seconds"] <= 3600
    assert status["dead_letters"] == {"waiting": 2}
    assert status["recent"]["minutes"] == 15
    assert status["recent"]["attempts"] == {"delivered": 5, "retry": 2, "dead_letter": 1}
    assert status["recent"]["duration_ms"]["delivered"]["p50"] == 30.0
    consumer = status["consumer"]
    assert consumer["endpoint"] == "https://consumer.example"
    assert consumer["redis"]["reachable"] is True
    breaker = consumer["breaker"]
    assert (breaker["state"], breaker["failures"], breaker["enabled"]) == ("open", 3, True)
    assert 0 < breaker["reset_in_seconds"] <= 60
    assert consumer["rate_limit"] == {"attempts_last_second": 2}
    assert "status-query-token" not in out and "/in/hook" not in out

    # A wider window counts the older attempts too.
    code, out = await run_command("status", "--json", "--minutes", "180", env=env)
    assert code == 0, out
    assert json.loads(out)["recent"]["attempts"]["delivered"] == 12

    code, out = await run_command("status", env=env)
    assert code == 0, out
    for text in ("pending", "due now", "dead letters waiting", "delivered", "open"):
        assert text in out, out
    assert "https://consumer.example" in out
    assert "status-query-token" not in out and "Traceback" not in out


async def test_status_says_redis_is_unreachable_and_still_shows_the_database(
    database_url: str, tmp_path: Path
) -> None:
    await _seed(database_url)
    env = _env(database_url, tmp_path, REDIS_URL="redis://127.0.0.1:1/0", WEBHOOK_URL=CONSUMER)
    code, out = await run_command("status", "--json", env=env)
    assert code == 0, out
    status = json.loads(out)
    assert status["backlog"]["pending"] == 7
    assert status["consumer"]["redis"]["reachable"] is False
    assert status["consumer"]["redis"]["error"]
    assert status["consumer"]["breaker"] is None
    code, out = await run_command("status", env=env)
    assert code == 0, out
    assert "unreachable" in out and "Traceback" not in out


async def test_status_without_webhook_url_shows_the_database_only(
    database_url: str, tmp_path: Path
) -> None:
    await _seed(database_url)
    env = _env(database_url, tmp_path)  # no WEBHOOK_URL, no REDIS_URL
    code, out = await run_command("status", "--json", env=env)
    assert code == 0, out
    status = json.loads(out)
    assert status["consumer"] is None
    assert status["dead_letters"] == {"waiting": 2}
    code, out = await run_command("status", env=env)
    assert code == 0 and "WEBHOOK_URL is not set" in out, out
    # No embedded Redis was started just to say so.
    assert not (tmp_path / "home").exists() or not any((tmp_path / "home").rglob("*redis*"))


async def test_status_help_and_an_unmigrated_database(
    empty_database_url: str, tmp_path: Path
) -> None:
    env = _env(empty_database_url, tmp_path)
    code, out = await run_command("status", "--help", env=env)
    assert code == 0 and "usage: fluxora-webhooks status" in out and "--json" in out, out
    code, out = await run_command("status", env=env)
    assert code == 3 and "fluxora-webhooks migrate" in out, out
    assert "Traceback" not in out


async def _seed_history(database_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload, created_at, processed,"
            " processed_at, outcome)"
            " SELECT CASE WHEN g <= 25 THEN 'old' ELSE 'new' END, 'e', '{}'::jsonb,"
            "   now() - interval '30 days', true,"
            "   now() - CASE WHEN g <= 25 THEN interval '8 days' ELSE interval '6 days' END,"
            "   'delivered'"
            " FROM generate_series(1, 40) g"
        )
        # Pending rows enqueued long ago: never pruned.
        await conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload, created_at, enqueued_at)"
            " SELECT 'pending', 'e', '{}'::jsonb, now() + interval '1 day',"
            "   now() - interval '30 days' FROM generate_series(1, 3)"
        )
        await conn.execute(
            "INSERT INTO webhook_dead_letter (delivery_id, stream_id, event_type, payload,"
            " attempts, reason, enqueued_at, dead_at, state, state_changed_at)"
            " SELECT gen_random_uuid(), 'd', 'e', '{}'::jsonb, 8, 'http_4xx',"
            "   now() - interval '20 days', now() - interval '20 days', s,"
            "   CASE WHEN s = 'dead' THEN NULL ELSE now() - interval '10 days' END"
            " FROM unnest(ARRAY['dead', 'replayed', 'purged', 'purged']) s"
        )


async def _outbox(database_url: str, stream_id: str) -> int:
    return int(
        await scalar(
            database_url, "SELECT count(*) FROM webhook_outbox WHERE stream_id = %s", (stream_id,)
        )
    )


async def test_prune_deletes_old_history_only(database_url: str, tmp_path: Path) -> None:
    await _seed_history(database_url)
    env = _env(database_url, tmp_path)

    code, out = await run_command("prune", "--older-than", "7d", "--dry-run", "--json", env=env)
    assert code == 0, out
    assert json.loads(out)["outbox_rows"] == 25 and await _outbox(database_url, "old") == 25

    code, out = await run_command(
        "prune", "--older-than", "7d", "--batch-size", "10", "--json", env=env
    )
    assert code == 0, out
    result = json.loads(out)
    assert (result["outbox_rows"], result["dead_letters"], result["batches"]) == (25, 0, 3)
    assert await _outbox(database_url, "old") == 0
    assert await _outbox(database_url, "new") == 15
    assert await _outbox(database_url, "pending") == 3
    assert int(await scalar(database_url, "SELECT count(*) FROM webhook_dead_letter")) == 4

    code, out = await run_command("prune", "--older-than", "7d", "--dead-letters", env=env)
    assert code == 0, out
    assert "deleted 0 processed outbox row(s)" in out
    assert "deleted 3 replayed or purged dead letter(s)" in out
    assert await rows(database_url, "SELECT state FROM webhook_dead_letter") == [("dead",)]

    code, out = await run_command("prune", "--older-than", "5d", "--json", env=env)
    assert code == 0 and json.loads(out)["outbox_rows"] == 15, out
    assert await _outbox(database_url, "pending") == 3


async def test_prune_refuses_bad_arguments(database_url: str, tmp_path: Path) -> None:
    env = _env(database_url, tmp_path)
    code, out = await run_command("prune", "--help", env=env)
    assert code == 0 and "--older-than" in out and "--dead-letters" in out, out
    code, out = await run_command("prune", "--older-than", "7 days", env=env)
    assert code == 2 and "error: --older-than" in out, out
    code, out = await run_command("prune", "--older-than", "7d", "--batch-size", "0", env=env)
    assert code == 2 and "--batch-size" in out, out
    code, out = await run_command("prune", env=env)
    assert code == 2 and "--older-than" in out, out
    assert "Traceback" not in out
