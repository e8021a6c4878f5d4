"""A consumer process for the inbox's end-to-end tests: an aiohttp app on the inbox glue
(:func:`fluxora_webhooks.inbox.aiohttp.inbox_handler`) that credits a balance in its own
database, in the inbox's transaction, and can be told to fail in the ways that matter::

    python -m tests.support.inbox_consumer --port 8080

Environment:

- ``CONSUMER_DATABASE_URL``, ``WEBHOOK_SECRET``: its database (with ``webhook_inbox``,
  ``balance`` and ``applied``) and the sender's secret.
- ``CONSUMER_SEED``: seeds the choices below.
- ``CONSUMER_UNAVAILABLE_RATE``: that fraction of requests is answered 503 at once.
- ``CONSUMER_KILL_BEFORE_COMMIT_RATE``: that fraction of new events SIGKILLs the process
  after its writes, before the commit (PostgreSQL rolls the transaction back).
- ``CONSUMER_KILL_AFTER_COMMIT_RATE``: that fraction of processed events SIGKILLs the
  process after the commit, before the response is written: the sender sees a failure and
  retries what was already applied.
- ``CONSUMER_WAIT_FOR_GO``: a warm spare: import everything, then wait for a line on stdin
  before listening (so a restart after a kill costs no start-up time).
- ``CONSUMER_HOLD_LOCK``: an advisory lock key the handler waits for (shared) after its
  writes and before the commit, so a test can hold a transaction open.

Several replicas may listen on one port (``SO_REUSEPORT``). Each prints ``ready`` once it
listens, and announces each self-kill on stdout first: ``kill before-commit <id>`` or
``kill after-commit <id>``. ``applied`` counts the handler's runs per delivery id in the
same transaction as the credit: a count of 2 would be an event applied twice.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any

import psycopg
from aiohttp import web
from psycopg_pool import AsyncConnectionPool

from fluxora_webhooks.inbox import InboxEvent
from fluxora_webhooks.inbox.aiohttp import inbox_handler

TABLES = """
CREATE TABLE IF NOT EXISTS balance (id int PRIMARY KEY, amount bigint NOT NULL);
INSERT INTO balance VALUES (1, 0) ON CONFLICT DO NOTHING;
CREATE TABLE IF NOT EXISTS applied (delivery_id text PRIMARY KEY, count int NOT NULL);
"""


def _rate(env: dict[str, str], name: str) -> float:
    return float(env.get(name, "0") or 0)


def _die(when: str, delivery_id: str) -> None:
    sys.stdout.write(f"kill {when} {delivery_id}\n")
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def make_app(env: dict[str, str]) -> web.Application:
    rng = random.Random(env.get("CONSUMER_SEED", "0"))
    unavailable = _rate(env, "CONSUMER_UNAVAILABLE_RATE")
    kill_before = _rate(env, "CONSUMER_KILL_BEFORE_COMMIT_RATE")
    kill_after = _rate(env, "CONSUMER_KILL_AFTER_COMMIT_RATE")
    hold = env.get("CONSUMER_HOLD_LOCK")
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        env["CONSUMER_DATABASE_URL"], min_size=2, max_size=8, open=False
    )

    async def credit(event: InboxEvent, conn: psycopg.AsyncConnection[Any], _: Any) -> None:
        await conn.execute(
            "INSERT INTO applied (delivery_id, count) VALUES (%s, 1)"
            " ON CONFLICT (delivery_id) DO UPDATE SET count = applied.count + 1",
            (event.delivery_id,),
        )
        await conn.execute(
            "UPDATE balance SET amount = amount + %s WHERE id = 1", (event.payload["amount"],)
        )
        if hold:
            await conn.execute("SELECT pg_advisory_xact_lock_shared(%s)", (int(hold),))
        if rng.random() < kill_before:
            _die("before-commit", event.delivery_id)

    inbox = inbox_handler(pool, credit, secret=env["WEBHOOK_SECRET"])

    async def hook(request: web.Request) -> web.Response:
        if rng.random() < unavailable:
            return web.json_response({"error": "unavailable"}, status=503)
        response = await inbox(request)
        if response.status == 200 and response.text and rng.random() < kill_after:
            answer = json.loads(response.text)
            if answer["status"] == "processed":
                _die("after-commit", answer["delivery_id"])  # committed, never answered
        return response

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        await pool.open(wait=True)
        yield
        await pool.close()

    app = web.Application()
    app.router.add_post("/hook", hook)
    app.cleanup_ctx.append(lifecycle)
    return app


async def prepare(database_url: str) -> None:
    """The consumer's own tables (the inbox is installed by ``fluxora-webhooks inbox``)."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(TABLES)


def _ready(*_: object) -> None:
    """Called once the server listens: a line the test waits for."""
    sys.stdout.write("ready\n")
    sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    env = dict(os.environ)
    app = make_app(env)
    if env.get("CONSUMER_WAIT_FOR_GO") and not sys.stdin.readline():
        return 0  # a spare that was never needed
    web.run_app(
        app,
        host="127.0.0.1",
        port=args.port,
        access_log=None,
        print=_ready,
        reuse_address=True,
        reuse_port=True,  # replicas on one port: the kernel spreads connections over them
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
