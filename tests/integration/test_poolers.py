"""Behind PgBouncer (docs/scaling.md, "Connection poolers"): in session mode everything
works; in transaction mode `run`, `api`, `migrate` and `prune` refuse to start, naming
the pooler (through one the dispatcher's wake-ups never arrived, batches were sent twice
and its session locks did not exclude), while producers that prepare no statements
enqueue through it."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from fluxora_webhooks.errors import ConfigError
from fluxora_webhooks.migrations import check_session_pooling
from fluxora_webhooks.outbox import enqueue
from tests.support.dispatch import scalar
from tests.support.pgbouncer import pgbouncer, through
from tests.support.procs import command_env, run_command

pytestmark = pytest.mark.integration

POOLER = "DATABASE_URL goes through a connection pooler in transaction mode"


async def probe(url: str) -> None:
    async with await psycopg.AsyncConnection.connect(
        url, autocommit=True, prepare_threshold=None
    ) as conn:
        await check_session_pooling(conn, url)


async def test_a_session_pool_and_a_direct_connection_pass_a_transaction_pool_is_named(
    database_url: str,
) -> None:
    await probe(database_url)
    with pgbouncer("session") as port:
        await probe(through(database_url, port))
    with pgbouncer("transaction") as port, pytest.raises(ConfigError) as refused:
        await probe(through(database_url, port))
    assert refused.value.variable == "DATABASE_URL" and POOLER in str(refused.value)


async def test_commands_that_need_their_session_refuse_a_transaction_pool(
    database_url: str, redis_url: str, prefix: str
) -> None:
    with pgbouncer("transaction") as port:
        env = command_env(
            DATABASE_URL=through(database_url, port),
            REDIS_URL=redis_url,
            FLUXORA_REDIS_PREFIX=prefix,
            WEBHOOK_WORKERS="1",
            WEBHOOK_METRICS_PORT="0",
        )
        for args in (("run",), ("api",), ("migrate",), ("prune", "--older-than", "7d")):
            code, out = await run_command(*args, env=env, timeout=60)
            assert code == 2 and POOLER in out, (args, out)


async def test_producers_that_prepare_nothing_enqueue_through_a_transaction_pool(
    database_url: str,
) -> None:
    """What docs/scaling.md tells producers behind such a pool: prepare_threshold=None."""
    with pgbouncer("transaction", pool_size=2) as port:
        url = through(database_url, port)

        async def produce(worker: int) -> None:
            async with await psycopg.AsyncConnection.connect(url, prepare_threshold=None) as conn:
                for i in range(40):
                    async with conn.transaction():
                        await enqueue(
                            conn, stream_id=f"w{worker}", event_type="thing.done", payload={"i": i}
                        )

        await asyncio.gather(*(produce(w) for w in range(4)))
    assert await scalar(database_url, "SELECT count(*) FROM webhook_outbox") == 160
