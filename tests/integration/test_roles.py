"""The least privileges of docs/operations.md, "Roles and privileges", proven: the SQL
blocks of that section are read from the page and applied as written (each role name made
unique: roles are the cluster's), then every role does its job with them: the owner
migrates (into ``public``, and into a schema of its own), the producer enqueues, the
dispatcher (``run``) delivers, retries, dead-letters and prunes, the API (``api``)
replays, writes and reads, a read-only API reads, ``prune`` prunes and a consumer's inbox
receives a delivery twice. Every process runs at DEBUG, where a refusal it takes in its
stride would be said, and none says one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import sys
from collections.abc import AsyncIterator, Awaitable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import psycopg
import pytest
from aiohttp import web
from psycopg import sql

from fluxora_webhooks import enqueue, inbox, tokens
from fluxora_webhooks.errors import SchemaError
from fluxora_webhooks.migrations import check_schema
from tests.support.api import Api
from tests.support.dispatch import SECRET, wait_until
from tests.support.procs import (
    command_env,
    dispatcher_env,
    free_port,
    run_command,
    start_dispatcher,
)
from tests.support.receiver import Received, Receiver
from tests.support.scrape import is_ready, scrape, total

pytestmark = pytest.mark.integration

DOCS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
SECTION = "## Roles and privileges"
# A block: its marker, then the fenced SQL right after it.
BLOCK = re.compile(r"<!-- roles:([a-z-]+) -->\n```sql\n(.*?)```", re.DOTALL)
BLOCKS = {
    "create",
    "producer",
    "dispatcher",
    "dispatcher-retention",
    "dispatcher-api",
    "api",
    "api-reader",
    "api-reader-dashboard",
    "pruner",
    "inbox",
    "schema",
    "search-path",
}
# The grants the owner makes once its tables exist.
GRANTS = ("producer", "dispatcher", "api", "api-reader", "pruner")
ROLES = (
    "webhooks_owner",
    "webhooks_dispatcher",
    "webhooks_api_reader",
    "webhooks_api",
    "webhooks_pruner",
    "app_producer",
    "app_consumer",
)
# The search path of "Another schema" in a DATABASE_URL, as the page writes it.
SEARCH_PATH_OPTION = "options=-c%20search_path%3Dwebhooks"
REFUSED = re.compile(r"permission denied|InsufficientPrivilege|must be owner", re.IGNORECASE)
PAUSED = {"stream_id": "s-1", "event_type": "stream.paused"}


def doc_blocks() -> dict[str, str]:
    """The section's SQL blocks by marker: every one expected, each once."""
    text = DOCS.read_text("utf-8")
    start = text.index(f"\n{SECTION}\n")
    end = text.find("\n## ", start + 1)
    section = text[start : end if end >= 0 else len(text)]
    found = BLOCK.findall(section)
    blocks = dict(found)
    assert len(blocks) == len(found) and set(blocks) == BLOCKS, sorted(blocks)
    assert SEARCH_PATH_OPTION in section
    return blocks


class Roles:
    """This test's roles: ``role(name)`` is a role's unique name, ``sql(block)`` a block of
    the page naming them, ``url(name, database)`` a role's DATABASE_URL."""

    def __init__(self, admin_url: str, suffix: str) -> None:
        assert admin_url.startswith("postgres"), "the test needs a URL, not key=value"
        self.admin_url = admin_url
        self.suffix = suffix
        self.blocks = doc_blocks()
        self._names = re.compile(r"\b(" + "|".join(ROLES) + r")\b")

    def role(self, name: str) -> str:
        assert name in ROLES
        return f"{name}_{self.suffix}"

    def sql(self, block: str) -> str:
        return self._names.sub(lambda m: self.role(m.group(1)), self.blocks[block])

    def url(self, name: str | None, database: str, query: str = "") -> str:
        """``name``'s URL (None: the superuser's), with ``query`` added."""
        parts = urlsplit(self.admin_url)
        user, _, host = parts.netloc.rpartition("@")
        if name is not None:
            user = self.role(name)
        joined = "&".join(q for q in (parts.query, query) if q)
        return urlunsplit(
            parts._replace(netloc=f"{user}@{host}", path=f"/{database}", query=joined)
        )

    def run(self, url: str, text: str) -> None:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(text.encode())

    def apply(self, block: str, database: str, as_role: str | None, query: str = "") -> None:
        """The page's ``block``, run by ``as_role`` (None: the superuser)."""
        self.run(self.url(as_role, database, query), self.sql(block))


def database_of(url: str) -> str:
    return urlsplit(url).path.lstrip("/")


@contextlib.contextmanager
def scratch_database(roles: Roles, name: str) -> Iterator[str]:
    admin = roles.url(None, database_of(roles.admin_url))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield name
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def drop_roles(roles: Roles, databases: list[str]) -> None:
    """Whatever the test made: REASSIGN and DROP OWNED in each database still there, then
    the roles."""
    maintenance = roles.url(None, database_of(roles.admin_url))
    with psycopg.connect(maintenance, autocommit=True) as conn:
        wanted = [roles.role(r) for r in ROLES]
        cur = conn.execute("SELECT rolname FROM pg_roles WHERE rolname = ANY(%s)", (wanted,))
        names = [str(r[0]) for r in cur.fetchall()]
        cur = conn.execute("SELECT datname FROM pg_database WHERE datname = ANY(%s)", (databases,))
        alive = [str(r[0]) for r in cur.fetchall()]
    if not names:
        return
    listed = sql.SQL(", ").join(sql.Identifier(n) for n in names)
    for database in alive:
        with psycopg.connect(roles.url(None, database), autocommit=True) as conn:
            conn.execute(sql.SQL("REASSIGN OWNED BY {} TO CURRENT_USER").format(listed))
            conn.execute(sql.SQL("DROP OWNED BY {}").format(listed))
    with psycopg.connect(maintenance, autocommit=True) as conn:
        for name in names:
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))


async def scalar_as(url: str, query: str, params: Any = None) -> Any:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as aconn:
        row = await (await aconn.execute(query, params)).fetchone()
        return None if row is None else row[0]


async def non_empty(items: Awaitable[list[Any]]) -> bool:
    return bool(await items)


@contextlib.asynccontextmanager
async def api_command(env: dict[str, str], out: list[str]) -> AsyncIterator[str]:
    """``fluxora-webhooks api`` on a free port: its URL while it runs, its output in
    ``out``; it exits 0 on SIGTERM."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "fluxora_webhooks",
        "api",
        env={**env, "WEBHOOK_API_PORT": "0"},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    serving: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def drain() -> None:
        assert proc.stdout is not None
        async for raw in proc.stdout:
            line = raw.decode(errors="replace")
            out.append(line)
            found = re.search(r"serving on (http://\S+?)/? ", line)
            if found and not serving.done():
                serving.set_result(found.group(1))
        if not serving.done():
            serving.set_exception(AssertionError("api exited:\n" + "".join(out)))

    reading = asyncio.create_task(drain())
    try:
        yield await asyncio.wait_for(serving, 30)
    finally:
        if proc.returncode is None:
            proc.terminate()
        code = await asyncio.wait_for(proc.wait(), 30)
        await reading
    assert code == 0, "".join(out)


@dataclass
class Browser:
    """A dashboard session (its cookies), on one API or another."""

    session: aiohttp.ClientSession

    async def sign_in(self, base: str, token: str) -> int:
        """The status of the sign-in's POST (303 when it worked)."""
        async with self.session.get(base + "/login") as resp:
            nonce = re.search(r'name="nonce" value="([^"]+)"', await resp.text())
        assert nonce is not None
        form = {"token": token, "nonce": nonce.group(1)}
        async with self.session.post(base + "/login", data=form, allow_redirects=False) as resp:
            return resp.status

    async def sign_out(self, base: str) -> int:
        async with self.session.get(base + "/deliveries") as resp:
            assert resp.status == 200
            csrf = re.search(r'name="csrf" value="([^"]+)"', await resp.text())
        assert csrf is not None
        form = {"csrf": csrf.group(1)}
        async with self.session.post(base + "/logout", data=form, allow_redirects=False) as resp:
            return resp.status


@dataclass
class Scene:
    """What the parts of the test share."""

    roles: Roles
    main: str  # the outbox's database (public schema)
    schema_db: str  # the outbox in a schema of its own
    inbox_db: str  # a consumer's database
    receiver: Receiver
    first_id: str = ""  # the event that fails, 500 then 400, until it is replayed
    replayed: bool = False
    made: dict[str, str] = field(default_factory=dict)  # the API tokens by name

    @property
    def owner(self) -> str:
        return self.roles.url("webhooks_owner", self.main)

    def respond(self, item: Received) -> web.Response:
        if item.delivery_id == self.first_id and not self.replayed:
            return web.Response(status=500 if item.attempt == 1 else 400, text="no")
        return web.Response(status=200, text="ok")


async def test_each_role_does_its_job_with_the_documented_grants(
    pg_admin_url: str,
    empty_database_url: str,
    redis_url: str,
    prefix: str,
    receiver: Receiver,
    tmp_path: Path,
) -> None:
    main = database_of(empty_database_url)
    suffix = main.rsplit("_", 1)[1]
    roles = Roles(pg_admin_url, suffix)
    schema_db, inbox_db = f"roles_s_{suffix}", f"roles_i_{suffix}"
    try:
        with scratch_database(roles, schema_db), scratch_database(roles, inbox_db):
            scene = Scene(roles, main, schema_db, inbox_db, receiver)
            receiver.respond = scene.respond
            await owner_migrates_and_grants(scene)
            second = await dispatcher_and_apis(scene, redis_url, prefix, tmp_path)
            inbox_receives_twice(scene, receiver.by_delivery()[second][0])
            await pruner_prunes(scene)
            scene.roles.apply("dispatcher-api", main, None)
            await another_schema(scene)
    finally:
        drop_roles(roles, [main, schema_db, inbox_db])


async def owner_migrates_and_grants(scene: Scene) -> None:
    roles, main, schema_db = scene.roles, scene.main, scene.schema_db
    roles.apply("create", main, None)
    for app_role in ("app_producer", "app_consumer"):  # the application's own
        roles.run(roles.url(None, main), f"CREATE ROLE {roles.role(app_role)} LOGIN")
    # "Another schema" too, its search path in the owner's URL.
    roles.apply("schema", schema_db, None)
    in_schema = roles.url("webhooks_owner", schema_db, SEARCH_PATH_OPTION)
    done = await asyncio.gather(
        run_command("migrate", env=command_env(DATABASE_URL=scene.owner)),
        run_command("migrate", env=command_env(DATABASE_URL=in_schema)),
    )
    for code, out in done:
        assert code == 0, out
    owners = "SELECT array_agg(DISTINCT tableowner::text) FROM pg_tables WHERE schemaname = %s"
    assert await scalar_as(scene.owner, owners, ("public",)) == [roles.role("webhooks_owner")]
    for block in GRANTS:
        roles.apply(block, main, "webhooks_owner")
        roles.apply(block, schema_db, "webhooks_owner", SEARCH_PATH_OPTION)
    roles.apply("dispatcher-retention", main, None)  # a membership: the roles' creator's
    # Tokens are the owner's to make (`tokens create`), never the API's.
    async with await psycopg.AsyncConnection.connect(scene.owner, autocommit=True) as aconn:
        for name, read_only in (("ops", False), ("boss", False), ("looker", True)):
            _, scene.made[name] = await tokens.create(aconn, name=name, read_only=read_only)


async def dispatcher_and_apis(scene: Scene, redis_url: str, prefix: str, tmp_path: Path) -> str:
    """The producer enqueues, ``run`` delivers, ``api`` replays and writes, a read-only
    ``api`` reads. Returns the delivery id of the event delivered at once."""
    roles, main = scene.roles, scene.main
    metrics_port = free_port()
    env = dispatcher_env(
        roles.url("webhooks_dispatcher", main),
        redis_url,
        scene.receiver.url,
        prefix,
        WEBHOOK_WORKERS="2",
        WEBHOOK_CLAIM_LOOPS="2",
        WEBHOOK_METRICS_PORT=str(metrics_port),
        WEBHOOK_POLL_INTERVAL_MS="200",
        WEBHOOK_RETRY_SCHEDULE="100ms",
        WEBHOOK_MAX_ATTEMPTS="3",
        WEBHOOK_RETENTION="1d",
        WEBHOOK_ALLOWED_NETWORKS="127.0.0.0/8",
        LOG_LEVEL="DEBUG",
    )

    def api_env(role: str) -> dict[str, str]:
        return command_env(
            DATABASE_URL=roles.url(role, main),
            REDIS_URL=redis_url,
            FLUXORA_REDIS_PREFIX=prefix,
            WEBHOOK_ALLOWED_NETWORKS="127.0.0.0/8",
            LOG_LEVEL="DEBUG",
        )

    api_out: list[str] = []
    reader_out: list[str] = []
    dispatcher = await start_dispatcher(env, tmp_path / "dispatcher.log")
    try:
        async with (
            api_command(api_env("webhooks_api"), api_out) as api_url,
            api_command(api_env("webhooks_api_reader"), reader_out) as reader_url,
            aiohttp.ClientSession() as session,
            aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as cookies,
        ):
            await wait_until(lambda: is_ready(metrics_port), 30, "the dispatcher ready")
            second = await producer_and_dispatcher(scene)
            api = Api(api_url, session, "", tokens=scene.made)
            await api_writes(scene, api, Browser(cookies))
            reader = Api(reader_url, session, "", tokens=scene.made)
            await reader_reads(scene, reader)
            # What the reader is refused next is refused on purpose: its output had none.
            reader_clean = "".join(reader_out)
            await reader_refused(scene, reader, Browser(cookies))

            # `run` pruned with the pruner's role (WEBHOOK_RETENTION) and read its gauges.
            samples = await scrape(metrics_port)
            assert total(samples, "fluxora_webhook_retention_runs_total", result="ok") >= 1
            assert total(samples, "fluxora_webhook_retention_runs_total", result="error") == 0
            assert total(samples, "fluxora_webhook_backlog_refresh_errors_total") == 0
            assert total(samples, "fluxora_webhook_backlog_refreshed_timestamp_seconds") > 0
            assert total(samples, "fluxora_webhook_claim_errors_total") == 0
    finally:
        dispatcher.terminate()
        status = await dispatcher.wait(30)
    log = dispatcher.log()
    assert status == 0, log
    for output in (log, "".join(api_out), reader_clean):
        assert not REFUSED.search(output), output
    # Its housekeeping recorded that it configures the built-in endpoint.
    seen = "SELECT count(*) FROM webhook_builtin_seen WHERE endpoint_id = 'default'"
    assert await scalar_as(scene.owner, seen) == 1
    return second


async def producer_and_dispatcher(scene: Scene) -> str:
    """enqueue() and the plain INSERT; then a retry, a dead letter and a delivery."""
    producer = scene.roles.url("app_producer", scene.main)
    with psycopg.connect(producer) as conn, conn.transaction():
        scene.first_id = enqueue(conn, **PAUSED, payload={"n": 1})
        conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload)"
            " VALUES ('s-2', 'stream.paused', '{\"n\": 2}'::jsonb)"
        )
    with (
        psycopg.connect(producer) as conn,
        pytest.raises(psycopg.errors.InsufficientPrivilege),
    ):
        conn.execute("SELECT payload FROM webhook_outbox")  # nobody else's events

    async def settled() -> bool:
        reason = await scalar_as(
            scene.owner,
            "SELECT reason FROM webhook_dead_letter WHERE delivery_id = %s",
            (scene.first_id,),
        )
        return reason == "http_4xx" and len(scene.receiver.received) >= 3

    await wait_until(settled, 15, "a dead letter and a delivery")
    seen = scene.receiver.by_delivery()
    assert [r.attempt for r in seen[scene.first_id]] == [1, 2]
    (second,) = [d for d in seen if d != scene.first_id]
    assert [r.attempt for r in seen[second]] == [1]
    return second


async def api_writes(scene: Scene, api: Api, browser: Browser) -> None:
    """A replay of the dead letter; an endpoint's life; an event, idempotent; a parked
    delivery dead-lettered with its endpoint; a dashboard session."""

    async def delivered(delivery_id: str) -> bool:
        shown = await api.get(f"/api/v1/deliveries/{delivery_id}", token="ops")
        assert shown.status == 200, shown.text
        return bool(shown.body["status"] == "delivered")

    async def routed(event_id: int) -> list[dict[str, Any]]:
        found = await api.get(f"/api/v1/events/{event_id}", token="ops")
        assert found.status == 200, found.text
        return list(found.body["deliveries"])

    scene.replayed = True
    replay = await api.post(f"/api/v1/deliveries/{scene.first_id}/replay", token="ops")
    assert replay.status == 202, replay.text
    await wait_until(lambda: delivered(scene.first_id), 15, "the replay delivered")
    assert [r.attempt for r in scene.receiver.by_delivery()[scene.first_id]] == [1, 2, 1]

    created = await api.post(
        "/api/v1/endpoints",
        token="ops",
        json={"url": scene.receiver.url, "tenant": "acme", "event_types": ["stream.*"]},
    )
    assert created.status == 201, created.text
    path = f"/api/v1/endpoints/{created.body['id']}"
    for method, action, body in (
        ("PATCH", "", {"description": "acme's"}),
        ("POST", "/disable", None),
        ("POST", "/enable", None),
        ("POST", "/rotate-secret", {"keep_previous": "1h"}),
        ("POST", "/recover", {"since": "1h"}),
    ):
        reply = await api.call(method, path + action, token="ops", json=body)
        assert reply.status == 200, (action, reply.text)

    event = {"tenant": "acme", **PAUSED, "payload": {"n": 3}}
    key = {"Idempotency-Key": f"roles-{scene.roles.suffix}"}
    sent = await api.post("/api/v1/events", token="ops", json=event, headers=key)
    assert sent.status == 202, sent.text
    again = await api.post("/api/v1/events", token="ops", json=event, headers=key)
    assert again.status == 202 and again.headers.get("idempotent-replayed") == "true"
    await wait_until(lambda: non_empty(routed(sent.body["id"])), 15, "the event routed")
    (to_acme,) = await routed(sent.body["id"])
    await wait_until(lambda: delivered(to_acme["delivery_id"]), 15, "the event delivered")

    assert (await api.post(path + "/disable", token="ops")).status == 200
    held = await api.post("/api/v1/events", token="ops", json={**event, "payload": {}})
    assert held.status == 202, held.text
    await wait_until(lambda: non_empty(routed(held.body["id"])), 15, "the event parked")
    (parked,) = await routed(held.body["id"])
    assert parked["status"] == "parked", parked
    assert (await api.call("DELETE", path, token="ops")).status == 204
    gone = await api.get(f"/api/v1/deliveries/{parked['delivery_id']}", token="ops")
    assert gone.body["dead_letter_reason"] == "endpoint_removed", gone.text

    for listed in ("endpoints", "events", "deliveries", "stats"):
        assert (await api.get(f"/api/v1/{listed}", token="ops")).status == 200
    assert await browser.sign_in(api.url, scene.made["ops"]) == 303
    assert await browser.sign_out(api.url) == 303
    used = "SELECT last_used_at IS NOT NULL FROM webhook_api_tokens WHERE name = 'ops'"
    assert await scalar_as(scene.owner, used)


async def reader_reads(scene: Scene, reader: Api) -> None:
    """Reads through the read-only role, with an admin token and a read-only one, their
    last use not recorded."""
    for token in ("boss", "looker"):
        for listed in ("endpoints", "events", "deliveries", "stats"):
            got = await reader.get(f"/api/v1/{listed}", token=token)
            assert got.status == 200, got.text
        got = await reader.get(f"/api/v1/deliveries/{scene.first_id}", token=token)
        assert got.status == 200 and got.body["status"] == "delivered", got.text
    used = (
        "SELECT bool_or(last_used_at IS NOT NULL) FROM webhook_api_tokens"
        " WHERE name IN ('boss', 'looker')"
    )
    assert await scalar_as(scene.owner, used) is False


async def reader_refused(scene: Scene, reader: Api, browser: Browser) -> None:
    """A read-only token's write is 403; an admin token's fails on the role. A dashboard
    sign-in writes a session: refused, until the page's dashboard block is applied."""
    write = {"url": scene.receiver.url, "tenant": "acme"}
    refused = await reader.post("/api/v1/endpoints", token="looker", json=write)
    assert refused.status == 403 and refused.error_code == "read_only"
    denied = await reader.post("/api/v1/endpoints", token="boss", json=write)
    assert denied.status == 500 and denied.error_code == "database_privilege", denied.text
    assert "permission denied for table webhook_endpoints" in denied.text
    assert await browser.sign_in(reader.url, scene.made["looker"]) != 303
    scene.roles.apply("api-reader-dashboard", scene.main, "webhooks_owner")
    assert await browser.sign_in(reader.url, scene.made["looker"]) == 303
    assert await browser.sign_out(reader.url) == 303


def inbox_receives_twice(scene: Scene, request: Received) -> None:
    """The consumer's inbox in its own database: a real delivery received twice."""
    roles = scene.roles
    with psycopg.connect(roles.url(None, scene.inbox_db), autocommit=True) as conn:
        inbox.install(conn)
    roles.apply("inbox", scene.inbox_db, None)
    applied = []
    with psycopg.connect(roles.url("app_consumer", scene.inbox_db)) as conn:
        for _ in range(2):
            with conn.transaction():
                got = inbox.receive(conn, body=request.body, headers=request.headers, secret=SECRET)
                applied.append(None if got is None else got.delivery_id)
    assert applied == [request.delivery_id, None]


async def pruner_prunes(scene: Scene) -> None:
    """`prune` of the history older than a day (made so) and of the replayed dead letter."""
    with psycopg.connect(scene.roles.url(None, scene.main), autocommit=True) as conn:
        conn.execute(
            "UPDATE webhook_outbox SET processed_at = processed_at - interval '2 days'"
            " WHERE processed"
        )
        conn.execute("UPDATE webhook_dead_letter SET state_changed_at = now() - interval '2d'")
        row = conn.execute("SELECT count(*) FROM webhook_outbox WHERE processed").fetchone()
    assert row is not None and row[0] > 0
    pruner = scene.roles.url("webhooks_pruner", scene.main)
    code, out = await run_command(
        "prune",
        "--older-than",
        "1d",
        "--dead-letters",
        "--json",
        env=command_env(DATABASE_URL=pruner),
    )
    assert code == 0, out
    pruned = json.loads(out.strip().splitlines()[-1])
    assert pruned["outbox_rows"] == row[0] and pruned["dead_letters"] == 1, out


async def another_schema(scene: Scene) -> None:
    """The installation in its own schema: a role whose search path misses it is told
    where it is; ALTER ROLE gives the path to the producer and the pruner."""
    roles, schema_db = scene.roles, scene.schema_db
    with pytest.raises(SchemaError, match="schema webhooks of this database holds one"):
        async with await psycopg.AsyncConnection.connect(
            roles.url("webhooks_pruner", schema_db), autocommit=True
        ) as aconn:
            await check_schema(aconn)
    roles.apply("search-path", schema_db, None)
    with psycopg.connect(roles.url("app_producer", schema_db)) as conn, conn.transaction():
        assert enqueue(conn, **PAUSED, payload={})
    code, out = await run_command(
        "prune",
        "--older-than",
        "1d",
        "--dry-run",
        env=command_env(DATABASE_URL=roles.url("webhooks_pruner", schema_db)),
    )
    assert code == 0, out
    pending = "SELECT count(*) FROM webhooks.webhook_outbox WHERE NOT processed"
    assert await scalar_as(roles.url("webhooks_owner", schema_db), pending) == 1
