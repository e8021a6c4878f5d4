"""A customer's Node.js consumer verifies real deliveries with the official Standard Webhooks
packages (docs/security.md, "From Node.js"): examples/node/receiver.js on npm's
`standardwebhooks`, every request checked by `svix` too, fed by a real `fluxora-webhooks run`.

Plain, non-ASCII and large payloads, custom headers, fan-out (each endpoint its own id and
secret), a handler that fails twice (the same webhook-id on every retry, applied once), an
answer lost after the event was applied (the retry is a repeat, not applied again), a secret
in rotation (two `v1,` entries, either secret verifies), then after it (the new one only),
and a plain (non-whsec) secret given to the libraries as the docs say. Needs Node.js and the
pinned packages: `make node` (a part of `make test`) installs them; without them this test
fails, never skips."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest

from fluxora_webhooks import endpoints
from tests.support.api import LOOPBACK
from tests.support.dispatch import rows
from tests.support.procs import dispatcher_env, dispatchers, free_port

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "node"
HARNESS = ROOT / "tests" / "support" / "node_consumer.js"
PLAIN_SECRET = "plain-text-secret-of-the-globex-endpoint:42"

SIGNED_HEADERS = {
    "webhook-id", "webhook-timestamp", "webhook-signature", "x-fluxora-delivery-id",
    "x-fluxora-event", "x-fluxora-timestamp", "x-fluxora-signature", "x-fluxora-attempt",
}  # fmt: skip

# What a producer in any language writes (plain SQL): the body each consumer must receive is
# PostgreSQL's jsonb text of it, byte for byte.
UNICODE = '{"name": "Zoë 🚀 日本語 é", "sep": "\\u2028", "q": "tab\\t\\"x\\"", "n": 1e3}'
BIG = json.dumps({"text": "é" * 250_000, "emoji": "🚀" * 40_000}, ensure_ascii=False)
EVENTS = [
    ("stream.updated", '{"id": 1, "amount": 12.5}'),
    ("stream.unicode", UNICODE),
    ("stream.big", BIG),
    ("test.fail-twice", '{"k": "retried"}'),
    ("test.lose-answer", '{"k": "lost"}'),
]


def node() -> str:
    """Node.js and the pinned packages, or a failure saying how to get them."""
    found = shutil.which("node")
    if found is None:
        pytest.fail("node is not installed: run `make node` (apt, as root)")
    for package in ("standardwebhooks", "svix"):
        if not (EXAMPLE / "node_modules" / package / "package.json").is_file():
            pytest.fail(f"examples/node lacks the npm package {package}: run `make node`")
    return found


class NodeConsumer:
    """The harness's JSON lines, collected as they come."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.requests: list[dict[str, Any]] = []
        self.applied: list[dict[str, Any]] = []
        self.ready = asyncio.Event()
        self.errors: list[str] = []

    async def read(self) -> None:
        assert self.proc.stdout is not None
        async for raw in self.proc.stdout:
            line = json.loads(raw)
            if "ready" in line:
                self.ready.set()
            elif "request" in line:
                self.requests.append(line["request"])
            elif "applied" in line:
                self.applied.append(line["applied"])

    async def wait_for(self, what: str, check: Any, timeout: float = 30) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while not check():
            refused = [r for r in self.requests if r["status"] == 401]
            if refused:  # the example's standardwebhooks refused a delivery: no need to wait
                shown = [
                    (r["receiver"], r["headers"]["x-fluxora-event"], r["checks"]) for r in refused
                ]
                raise AssertionError(f"deliveries failed verification: {shown[:3]}")
            if self.proc.returncode is not None:
                raise AssertionError(f"the Node consumer exited while waiting for {what}")
            if asyncio.get_running_loop().time() > deadline:
                seen = [(r["receiver"], r["status"]) for r in self.requests]
                raise AssertionError(f"timed out waiting for {what}: {seen}")
            await asyncio.sleep(0.05)


@asynccontextmanager
async def node_consumer(config: dict[str, Any]) -> AsyncIterator[NodeConsumer]:
    proc = await asyncio.create_subprocess_exec(
        node(), str(HARNESS), json.dumps(config), cwd=str(EXAMPLE),
        stdout=asyncio.subprocess.PIPE, limit=2**20,
    )  # fmt: skip
    consumer = NodeConsumer(proc)
    reader = asyncio.create_task(consumer.read())
    try:
        await asyncio.wait_for(consumer.ready.wait(), 30)
        yield consumer
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        reader.cancel()


async def produce(database_url: str, events: list[tuple[str, str]]) -> dict[str, bytes]:
    """The events written by plain SQL; each event type's body as jsonb writes it."""
    bodies = {}
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        for event_type, payload in events:
            await conn.execute(
                "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload)"
                " VALUES ('acme', 's-1', %s, %s::jsonb)",
                (event_type, payload),
            )
            cur = await conn.execute("SELECT %s::jsonb::text", (payload,))
            row = await cur.fetchone()
            assert row is not None
            bodies[event_type] = row[0].encode()
    return bodies


def by_id(requests: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {}
    for request in requests:
        found.setdefault(request["headers"]["webhook-id"], []).append(request)
    return found


async def test_a_node_consumer_verifies_every_delivery_with_the_official_packages(
    database_url: str, redis_url: str, redis_prefix: str, tmp_path: Path
) -> None:
    node()
    ports = {name: free_port() for name in ("ledger", "globex", "ledger-new")}
    url = {name: f"http://127.0.0.1:{port}/webhooks" for name, port in ports.items()}
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        ledger, old = await endpoints.create(
            conn, url=url["ledger"], tenant="acme", allowed_networks=LOOPBACK,
            headers={"X-Team": "billing", "X-Api-Key": "k-123"},
        )  # fmt: skip
        # A rotation in progress: the old secret keeps signing for an hour.
        _, new = await endpoints.rotate_secret(conn, ledger.id, keep_previous_ms=3_600_000)
        _, plain = await endpoints.create(
            conn, url=url["globex"], tenant="acme", secret=PLAIN_SECRET,
            allowed_networks=LOOPBACK,
        )  # fmt: skip
    assert old.startswith("whsec_") and new.startswith("whsec_") and plain == PLAIN_SECRET
    # A plain secret goes to a Standard Webhooks library as "whsec_" + its base64.
    converted = "whsec_" + base64.b64encode(PLAIN_SECRET.encode()).decode()
    config = {
        "receivers": [
            {"name": "ledger", "port": ports["ledger"], "secret": old},
            {"name": "globex", "port": ports["globex"], "secret": converted},
            {"name": "ledger-new", "port": ports["ledger-new"], "secret": new},
        ],
        "check": {"old": old, "new": new, "plain": converted},
    }
    env = dispatcher_env(
        database_url, redis_url, url["globex"], redis_prefix,
        WEBHOOK_ALLOWED_NETWORKS="127.0.0.0/8", WEBHOOK_RETRY_SCHEDULE="100ms",
        WEBHOOK_POLL_INTERVAL_MS="200",
    )  # fmt: skip
    for name in ("WEBHOOK_URL", "WEBHOOK_SECRET"):  # registered endpoints only
        env.pop(name)

    for phase in ("during", "after"):
        (tmp_path / phase).mkdir()
    async with node_consumer(config) as consumer:
        async with dispatchers(1, env, tmp_path / "during"):
            bodies = await produce(database_url, EVENTS)
            await consumer.wait_for(
                "every event applied at both endpoints",
                lambda: (
                    len(consumer.applied) == 2 * len(EVENTS)
                    and sum(r["status"] == 200 for r in consumer.requests) == 2 * len(EVENTS) + 2
                ),
            )
        during = list(consumer.requests)

        # Fan-out: every event reached both endpoints, under a delivery id of each.
        deliveries = by_id(during)
        assert len(deliveries) == 2 * len(EVENTS)
        for event_type in bodies:
            ids = {r["receiver"]: i for i, rs in deliveries.items() for r in rs
                   if r["headers"]["x-fluxora-event"] == event_type}  # fmt: skip
            assert set(ids) == {"ledger", "globex"} and ids["ledger"] != ids["globex"]

        for request in during:
            headers = request["headers"]
            event_type = headers["x-fluxora-event"]
            # The body as stored, byte for byte; the signed headers and no others.
            assert request["sha"] == hashlib.sha256(bodies[event_type]).hexdigest(), event_type
            assert {h for h in headers if h.startswith(("webhook-", "x-fluxora-"))} == (
                SIGNED_HEADERS
            )
            assert headers["webhook-id"] == headers["x-fluxora-delivery-id"]
            checks = request["checks"]
            if request["receiver"] == "ledger":
                # In rotation: one v1 entry per secret; the example (on the old secret),
                # svix and a string body verify with either secret, not with another's.
                assert len(headers["webhook-signature"].split()) == 2
                assert headers["x-team"] == "billing" and headers["x-api-key"] == "k-123"
                for name in ("old", "new"):
                    assert checks[f"svix:{name}"] == "ok", (event_type, checks)
                    assert checks[f"standardwebhooks-string:{name}"] == "ok", checks
                assert checks["svix:plain"] == "No matching signature found"
            else:
                assert len(headers["webhook-signature"].split()) == 1
                assert "x-team" not in headers and "x-api-key" not in headers
                assert checks["svix:plain"] == checks["standardwebhooks-string:plain"] == "ok"
                assert checks["svix:old"] == checks["svix:new"] == "No matching signature found"
            assert request["status"] in (200, 500), request  # never 401: verified

        # Each event applied once per endpoint, as parsed from the exact bytes.
        applied = {(a["receiver"], a["id"]): a for a in consumer.applied}
        assert len(applied) == len(consumer.applied)
        for (_, delivery_id), event in applied.items():
            assert event["event"] == json.loads(bodies[event["type"]]), event["type"]
            assert delivery_id in deliveries
        # A handler failing twice: three attempts of one delivery id, applied at the third.
        # An answer lost after the event was applied: the retry is answered, not applied.
        for delivery_id, requests in deliveries.items():
            kind = requests[0]["headers"]["x-fluxora-event"]
            seen = [(int(r["headers"]["x-fluxora-attempt"]), r["status"]) for r in requests]
            if kind == "test.fail-twice":
                assert seen == [(1, 500), (2, 500), (3, 200)], seen
                assert applied[(requests[0]["receiver"], delivery_id)]["attempt"] == 3
            elif kind == "test.lose-answer":
                assert seen == [(1, 200), (2, 200)] and requests[0].get("lost"), seen
            else:
                assert seen == [(1, 200)], (kind, seen)

        # After the rotation: the new secret alone; the consumer moved to it (another
        # process of it, on its new URL).
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            await endpoints.rotate_secret(conn, ledger.id, secret=new, keep_previous_ms=0)
            await endpoints.update(
                conn, ledger.id, endpoints.Changes(url=url["ledger-new"]),
                allowed_networks=LOOPBACK,
            )  # fmt: skip
        async with dispatchers(1, env, tmp_path / "after"):
            await produce(database_url, [("stream.after", '{"after": true}')])
            await consumer.wait_for(
                "the event after the rotation", lambda: len(consumer.applied) == 2 * 6
            )
        after = [r for r in consumer.requests if r["headers"]["x-fluxora-event"] == "stream.after"]
        assert sorted(r["receiver"] for r in after) == ["globex", "ledger-new"]
        for request in after:
            assert (
                request["status"] == 200
                and len(request["headers"]["webhook-signature"].split()) == 1
            )
            if request["receiver"] == "ledger-new":
                assert request["checks"]["svix:new"] == "ok"
                assert request["checks"]["svix:old"] == "No matching signature found"

    dead = await rows(database_url, "SELECT delivery_id FROM webhook_dead_letter")
    assert dead == []
