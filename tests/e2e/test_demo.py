"""`fluxora-webhooks demo` as a newcomer runs it: on the embedded engines (first run and
reuse), on configured engines, after a crashed run, and where it must refuse to run; its
checks, each able to fail; its consumers."""

from __future__ import annotations

import asyncio
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import psycopg
import pytest

from fluxora_webhooks import deliveries, endpoints, tokens
from fluxora_webhooks.demo import DemoOptions, run_demo
from fluxora_webhooks.demo import checks as demo_checks
from fluxora_webhooks.demo.cast import ACME, ALERTS, GLOBEX, LEDGER, PARTS, SYNC, TENANTS
from fluxora_webhooks.demo.checks import percentiles
from fluxora_webhooks.demo.consumer import Accepted, Consumer, event_key
from fluxora_webhooks.demo.dashboard import demo_token, describe, start_dashboard
from fluxora_webhooks.demo.runner import STEPS
from fluxora_webhooks.demo.streams import STREAM_PREFIX, Committed, burst, plan, shard
from fluxora_webhooks.embedded import EmbeddedEngines, stop_embedded
from fluxora_webhooks.errors import VerificationError
from fluxora_webhooks.signing import Signer
from tests.support.dispatch import scalar
from tests.support.procs import command_env, run_command

DEMO = ("demo", "--events", "60", "--no-live")
# The checks the demo makes: 4 (fan-out) + 4 (isolation, auto-disable) + 2 (back)
# + 3 (recovery) + 2 (ordering) + 5 (the whole run).
CHECKS = 20


@pytest.fixture(scope="module")
def demo_home() -> Iterator[Path]:
    """One embedded home for the module: the first run initialises it, later runs reuse it.

    Not under pytest's tmp_path: run as root, the server runs as another account that must
    traverse the folders above, and every pytest session that starts resets
    /tmp/pytest-of-<user> to 0700.
    """
    home = Path(tempfile.mkdtemp(prefix="fluxora-demo-test-"))
    try:
        yield home
    finally:
        stop_embedded(home)  # in case a failed test left the engines up
        shutil.rmtree(home, ignore_errors=True)


def figures(output: str) -> dict[str, int]:
    match = re.search(
        r"(\d+) stream writes committed \((\d+) rolled back\), (\d+) deliveries,"
        r" (\d+) operator events",
        output,
    )
    assert match, output
    names = ("committed", "rolled_back", "deliveries", "operator_events")
    return dict(zip(names, map(int, match.groups()), strict=True))


def assert_succeeded(code: int, output: str) -> dict[str, int]:
    """The run exited 0, every check printed held, and the figures add up."""
    assert code == 0, output
    assert "FAILED" not in output and "✗" not in output, output
    assert f"OK: all {CHECKS} checks held" in output, output
    held = re.findall(r"^  ✓ ", output, re.MULTILINE)
    assert len(held) == CHECKS, output
    for number, title in enumerate(STEPS, start=1):
        assert f"Step {number} · {title}" in output
    found = figures(output)
    assert 0 < found["rolled_back"] < found["committed"] < 60 + 15  # 60 writes + the burst
    # Fan-out: nothing crossed a tenant or a subscription.
    assert "(0 to another tenant, 0 outside a subscription)" in output
    # Auto-disable parked every delivery ledger did not get, and dead-lettered none.
    parked = re.search(r"(\d+) parked of (\d+) not delivered, 0 dead letters", output)
    assert parked and parked.group(1) == parked.group(2) and int(parked.group(1)) > 0
    resumed = re.search(r"(\d+)/(\d+) parked deliveries received", output)
    assert resumed and resumed.group(1) == resumed.group(2) == parked.group(1)
    # Recovery: every dead letter re-queued and delivered.
    recovered = re.search(r"(\d+) re-queued, (\d+)/(\d+) delivered, 0 still dead", output)
    assert recovered and len(set(recovered.groups())) == 1 and int(recovered.group(1)) > 0
    # Ordering: the held head, and nothing out of order.
    assert re.search(r"head answered 503 3 times for [\d.]+ s; meanwhile [1-9]\d* events", output)
    assert "0 out of order" in output
    assert "0 failures" in output  # signatures
    assert "0 pending, 0 dead letters" in output
    found["recovered"] = int(recovered.group(1))
    return found


@pytest.mark.e2e
@pytest.mark.slow
async def test_demo_runs_twice_on_the_embedded_engines(demo_home: Path) -> None:
    env = command_env(FLUXORA_HOME=str(demo_home))
    first = await run_command(*DEMO, env=env, timeout=150)
    one = assert_succeeded(*first)
    assert "Running on the embedded PostgreSQL and Redis" in first[1]
    assert (demo_home / "postgres" / "PG_VERSION").exists()

    second = await run_command(*DEMO, env=env, timeout=120)
    two = assert_succeeded(*second)
    assert "First run" not in second[1]  # the data folder was reused
    # The same seed plans the same writes, so both runs committed the same number.
    assert two["committed"] == one["committed"]


@pytest.mark.e2e
@pytest.mark.slow
async def test_a_killed_run_does_not_block_the_next(demo_home: Path) -> None:
    env = command_env(FLUXORA_HOME=str(demo_home))
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *("-m", "fluxora_webhooks", "demo", "--events", "5000", "--rate", "250", "--no-live"),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert proc.stdout is not None
    seen: list[str] = []
    try:
        async with asyncio.timeout(60):
            # Mid-run: stream writes committed and deliveries made.
            while not re.search(r"written [1-9]\d*/2000 · delivered [1-9]", "".join(seen[-1:])):
                line = await proc.stdout.readline()
                assert line, "the demo ended before it was killed:\n" + "".join(seen)
                seen.append(line.decode())
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
    assert proc.returncode == -signal.SIGKILL

    # The killed run left its writes, events and endpoints behind.
    with EmbeddedEngines(demo_home) as engines:
        database_url = engines.database_url()
        assert await scalar(database_url, "SELECT count(*) FROM demo_streams") > 0
        left = await scalar(
            database_url,
            "SELECT count(*) FROM webhook_outbox WHERE starts_with(tenant, %s)",
            (STREAM_PREFIX,),
        )
        assert left > 0

        assert_succeeded(*await run_command(*DEMO, env=env, timeout=120))
        # The killed run's endpoints are gone: only this run's cast is registered.
        assert await scalar(
            database_url,
            "SELECT count(*) FROM webhook_endpoints WHERE starts_with(tenant, %s)",
            (STREAM_PREFIX,),
        ) == len(PARTS)


@pytest.mark.e2e
@pytest.mark.slow
async def test_demo_on_configured_engines(
    database_url: str, redis_url: str, redis_prefix: str, tmp_path: Path
) -> None:
    env = command_env(
        DATABASE_URL=database_url,
        REDIS_URL=redis_url,
        FLUXORA_REDIS_PREFIX=redis_prefix,
        FLUXORA_HOME=str(tmp_path / "unused"),
    )
    code, output = await run_command(*DEMO, env=env, timeout=120)
    found = assert_succeeded(code, output)
    assert "embedded" not in output
    assert not (tmp_path / "unused").exists()

    # The database agrees with the summary, independently of the demo's own checks.
    async def count(sql: str, *params: Any) -> int:
        return int(await scalar(database_url, sql, params or None))

    assert await count("SELECT count(*) FROM webhook_outbox WHERE NOT processed") == 0
    registered = await count(
        "SELECT count(*) FROM webhook_endpoints WHERE state = 'enabled' AND tenant = ANY(%s)",
        list(TENANTS),
    )
    assert registered == len(PARTS)
    delivered = await count(
        "SELECT count(DISTINCT delivery_id) FROM webhook_outbox WHERE outcome = 'delivered'"
        " AND endpoint_id <> 'operator'"
    )
    assert delivered == found["deliveries"]
    # Each (event, endpoint) pair its own delivery id; no delivery to another tenant.
    assert (
        await count(
            "SELECT count(*) FROM (SELECT delivery_id FROM webhook_outbox"
            " WHERE endpoint_id IS NOT NULL GROUP BY delivery_id"
            " HAVING count(DISTINCT endpoint_id) > 1) x"
        )
        == 0
    )
    assert (
        await count(
            "SELECT count(*) FROM webhook_outbox o JOIN webhook_endpoints e ON e.id = o.endpoint_id"
            " WHERE o.tenant <> e.tenant"
        )
        == 0
    )
    # The recovered dead letters: replayed, none left dead; the operator heard of each.
    assert await count("SELECT count(*) FROM webhook_dead_letter WHERE state = 'dead'") == 0
    assert (
        await count("SELECT count(*) FROM webhook_dead_letter WHERE state = 'replayed'")
        == found["recovered"]
    )
    told = await count(
        "SELECT count(*) FROM webhook_outbox WHERE endpoint_id = 'operator'"
        " AND outcome = 'delivered' AND event_type = 'delivery.dead_lettered'"
    )
    assert told == found["recovered"]
    operator = await count(
        "SELECT count(*) FROM webhook_outbox WHERE endpoint_id = 'operator'"
        " AND outcome = 'delivered'"
    )
    assert operator == found["operator_events"] == found["recovered"] + 2  # disabled, enabled

    # The dashboard was started and named, with an admin token that works (not kept
    # running: the output is not a terminal).
    assert re.search(r"Dashboard: http://127\.0\.0\.1:\d+/", output), output
    assert re.search(r"API: http://127\.0\.0\.1:\d+/api/v1/stats", output), output
    token = re.search(r"Admin token \(shown once\): (fxa_\S+)", output)
    assert token and "Not kept running" in output
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        principal = await tokens.authenticate(conn, token.group(1))
        assert principal is not None and principal.admin
        shown, _ = await deliveries.list_deliveries(conn, tenant_filter=ACME, limit=1000)
        registry = await endpoints.list_endpoints(conn, tenant=ACME)
    assert shown and {d["endpoint_id"] for d in shown} <= {e.id for e in registry}


@pytest.mark.e2e
async def test_the_api_addresses_the_demo_prints_answer(database_url: str, redis_url: str) -> None:
    """The API line names addresses that answer with the printed token (the API's root,
    /api/v1/, is no resource: 404)."""
    server = await start_dashboard(database_url, redis_url, "127.0.0.1", 47531)
    try:
        token = await demo_token(database_url)
        api = next(line for line in describe(server.url, token, False) if line.startswith("API:"))
        addresses = re.findall(r"http://[^\s,]+", api)
        assert addresses == [f"{server.url}api/v1/stats", f"{server.url}api/v1/openapi.json"]
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as http:
            for address in addresses:
                async with http.get(address) as reply:
                    assert reply.status == 200, (address, await reply.text())
    finally:
        await server.stop()


@pytest.mark.e2e
async def test_demo_refuses_a_database_with_other_pending_events(
    database_url: str, redis_url: str, redis_prefix: str
) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload)"
            " VALUES ('customer-stream', 'stream.updated', '{}'::jsonb)"
        )
    env = command_env(
        DATABASE_URL=database_url, REDIS_URL=redis_url, FLUXORA_REDIS_PREFIX=redis_prefix
    )
    code, output = await run_command(*DEMO, env=env, timeout=60)
    assert code == 1, output
    assert "1 pending event(s) that are not the demo's" in output
    # Not delivered, not deleted.
    assert (
        await scalar(
            database_url,
            "SELECT count(*) FROM webhook_outbox WHERE stream_id = 'customer-stream'"
            " AND NOT processed",
        )
        == 1
    )


@pytest.mark.e2e
async def test_a_step_that_cannot_finish_fails_the_demo(
    database_url: str, redis_url: str, redis_prefix: str
) -> None:
    """Out of time in the first step: exit 1, the failed checks named, the rest not run."""
    env = command_env(
        DATABASE_URL=database_url, REDIS_URL=redis_url, FLUXORA_REDIS_PREFIX=redis_prefix
    )
    code, output = await run_command(
        "demo", "--events", "3000", "--rate", "100", "--timeout", "1", "--no-live", env=env
    )
    assert code == 1, output
    assert "FAILED: the result is not what the guarantees promise" in output
    assert "stopped: timed out" in output  # the summary's line of step 1
    assert re.search(r"✗ timed out after 1 s waiting for the fan-out's deliveries", output)
    assert "Step 2" not in output
    # The whole run's checks are still reported. Whether the events written before the
    # timeout all arrived depends on the machine (on a loaded one the producer wrote few,
    # and they did): the step's own failure above is what fails the demo.
    assert re.search(r"[✓✗] every event reached each endpoint of its tenant", output), output
    assert "OK: all" not in output


@pytest.mark.e2e
async def test_demo_help_and_bad_options() -> None:
    code, output = await run_command("demo", "--help", env=command_env(), timeout=30)
    assert code == 0, output
    for option in ("--events", "--seed", "--no-live", "--timeout", "--serve"):
        assert option in output
    for events in ("0", "29"):
        code, output = await run_command("demo", "--events", events, env=command_env(), timeout=30)
        assert code == 2, output
        assert "--events" in output


@pytest.mark.integration
async def test_the_verdict_catches_what_breaks_the_guarantees(
    database_url: str, redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Consumers that reject some signatures: the demo must not report success."""
    check = Consumer.check_signatures
    calls = 0

    def flaky(self: Consumer, body: bytes, headers: Any) -> str:
        nonlocal calls
        calls += 1
        if calls % 5 == 0:
            raise VerificationError("no_matching_signature", "tampered in the test")
        return check(self, body, headers)

    monkeypatch.setattr(Consumer, "check_signatures", flaky)
    report = await run_demo(
        DemoOptions(events=40, rate=0, timeout_s=5, redis_prefix=redis_prefix),
        database_url=database_url,
        redis_url=redis_url,
    )
    assert not report.ok
    failed = {c.claim for c in report.checks if not c.ok}
    assert any(c.startswith("every request's signature verified") for c in failed), failed
    # 401 is permanent: the rejected deliveries are dead letters, never delivered.
    assert any(c.startswith("every event reached each endpoint") for c in failed), failed
    assert any("nothing left pending or dead" in c for c in failed), failed
    assert any(c.startswith("timed out after 5 s") for c in failed), failed


# -- the checks, each able to fail -----------------------------------------------------------


def event(tenant: str, event_type: str, stream: str, version: int) -> Committed:
    return Committed(tenant, event_type, {"id": stream, "version": version}, 0.0)


def accept(consumer: Consumer, delivery_id: str, e: Committed, at: float = 0.0) -> None:
    consumer.accepted[delivery_id] = Accepted(e.event_type, e.payload, 1, at)
    consumer.seen[delivery_id] = e.key


def test_fan_out_check_finds_a_missing_and_a_cross_tenant_delivery() -> None:
    created = event(ACME, "stream.created", "s1", 1)
    paused = event(ACME, "stream.paused", "s1", 2)
    other = event(GLOBEX, "stream.created", "s2", 1)
    cast = {p: Consumer(p.label, "") for p in PARTS}
    accept(cast[LEDGER], "d1", created)
    accept(cast[LEDGER], "d2", paused)
    accept(cast[ALERTS], "d3", paused)
    accept(cast[SYNC], "d4", other)
    events = [created, paused, other]
    assert [c.ok for c in demo_checks.fan_out(events, cast)] == [False, True, True]  # crm: s2

    accept(cast[ALERTS], "d5", created)  # alerts does not subscribe to stream.created
    accept(cast[SYNC], "d6", paused)  # another tenant's event
    crossed = demo_checks.fan_out(events, cast)[1]
    assert not crossed.ok and "1 to another tenant, 1 outside a subscription" in crossed.detail
    accept(cast[ALERTS], "d2", paused)  # ledger's delivery id at alerts too
    assert not demo_checks.fan_out(events, cast)[2].ok


def test_own_secrets_check_finds_a_shared_secret() -> None:
    cast = {p: Consumer(p.label, endpoints.new_secret()) for p in PARTS}
    body = b'{"id": "s1", "version": 1}'

    def sign(consumer: Consumer) -> None:
        headers = Signer(consumer.secret.encode()).headers(
            delivery_id="d", event_type="stream.created", attempt=1, body=body,
            timestamp=int(time.time()),
        )  # fmt: skip
        consumer.sample = (body, headers)

    for consumer in cast.values():
        sign(consumer)
    assert demo_checks.own_secrets(cast).ok
    cast[SYNC].use_secret(cast[LEDGER].secret)  # two endpoints, one secret
    sign(cast[SYNC])
    shared = demo_checks.own_secrets(cast)
    assert not shared.ok and "2 verified" in shared.detail


def test_ordering_check_finds_a_later_event_first_and_a_stalled_stream() -> None:
    consumer = Consumer("globex/sync", "", ordered=True)
    held = consumer.hold_back("a", 3)
    held.refused, held.delivery_id, held.first_refused_at, held.accepted_at = 3, "a1", 1.0, 2.0
    events = [event(GLOBEX, "stream.updated", s, v) for s in ("a", "b") for v in (1, 2)]
    accept(consumer, "a1", events[0], at=2.0)
    accept(consumer, "a2", events[1], at=2.1)
    accept(consumer, "b1", events[2], at=1.2)
    accept(consumer, "b2", events[3], at=1.3)
    assert [c.ok for c in demo_checks.ordering(consumer, held, ["a", "b"], events)] == [True, True]

    consumer.accepted["a2"] = Accepted("stream.updated", events[1].payload, 1, 1.5)  # too soon
    assert [c.ok for c in demo_checks.ordering(consumer, held, ["a", "b"], events)] == [True, False]
    consumer.accepted["b1"] = Accepted("stream.updated", events[2].payload, 1, 2.5)
    consumer.accepted["b2"] = Accepted("stream.updated", events[3].payload, 1, 2.6)
    assert not demo_checks.ordering(consumer, held, ["a", "b"], events)[0].ok  # b waited too


def test_auto_disable_and_recovery_checks_need_what_they_claim() -> None:
    endpoint = endpoints.Endpoint(
        "ep", ACME, "http://127.0.0.1/", ("*",), state="disabled", disabled_reason="failing"
    )
    ok = [c.ok for c in demo_checks.auto_disabled(endpoint, disable_after_ms=1000, parked=3,
                                                  owed=3, dead_letters=0)]  # fmt: skip
    assert ok == [False, True]  # no streak recorded: not shown to be the failure streak
    assert not demo_checks.auto_disabled(
        endpoint, disable_after_ms=1000, parked=2, owed=3, dead_letters=0
    )[1].ok
    billing = Consumer("initech/billing", "")
    assert not demo_checks.recovered({"d1", "d2"}, 2, billing, 0).ok  # not delivered
    billing.accepted["d1"] = billing.accepted["d2"] = Accepted("stream.updated", {}, 1, 0.0)
    assert demo_checks.recovered({"d1", "d2"}, 2, billing, 0).ok
    assert not demo_checks.recovered(set(), 0, billing, 0).ok  # nothing shown


async def test_a_consumer_verifies_its_own_secret_and_the_order_of_a_stream() -> None:
    secret = endpoints.new_secret()
    consumer = Consumer("globex/sync", secret, ordered=True)
    await consumer.start()
    try:
        async with aiohttp.ClientSession() as http:

            async def post(key: str, stream: str, version: int, delivery: str) -> int:
                body = f'{{"id": "{stream}", "version": {version}}}'.encode()
                headers = Signer(key.encode()).headers(
                    delivery_id=delivery,
                    event_type="stream.updated",
                    attempt=1,
                    body=body,
                    timestamp=int(time.time()),
                )
                async with http.post(consumer.url, data=body, headers=headers) as response:
                    return response.status

            assert await post(endpoints.new_secret(), "a", 1, "d0") == 401  # another's secret
            consumer.hold_back("a", 1)
            assert await post(secret, "a", 1, "d1") == 503  # the held head
            assert await post(secret, "a", 2, "d2") == 200  # sent before its head: flagged
            assert await post(secret, "a", 1, "d1") == 200
            assert await post(secret, "a", 1, "d1") == 200  # a duplicate
    finally:
        await consumer.stop()
    assert consumer.signature_failures == 1
    assert consumer.duplicates == 1
    assert consumer.order_violations == ["a: version 2 arrived before version 1 was accepted"]
    assert set(consumer.accepted) == {"d1", "d2"}
    assert consumer.seen["d1"] == event_key("stream.updated", {"id": "a", "version": 1})


# -- the plan ---------------------------------------------------------------------------------


def test_the_plan_is_deterministic_and_rolls_some_writes_back() -> None:
    writes = plan(300, seed=7, tenants=TENANTS)
    assert writes == plan(300, seed=7, tenants=TENANTS)
    assert writes != plan(300, seed=8, tenants=TENANTS)
    assert {w.op for w in writes} == {"create", "update", "pause", "cancel"}
    assert 10 <= sum(w.fails for w in writes) <= 20
    # The tenants take turns; a stream belongs to one tenant.
    assert [w.tenant for w in writes[:6]] == [*TENANTS, *TENANTS]
    owner: dict[str, str] = {}
    # Nothing happens to a stream after its committed cancel, or before its committed create.
    created: set[str] = set()
    cancelled: set[str] = set()
    for w in writes:
        assert owner.setdefault(w.stream_id, w.tenant) == w.tenant
        assert w.stream_id not in cancelled
        if w.op == "create":
            assert w.stream_id not in created
        else:
            assert w.stream_id in created
        if not w.fails:
            if w.op == "create":
                created.add(w.stream_id)
            if w.op == "cancel":
                cancelled.add(w.stream_id)


def test_the_burst_interleaves_new_streams_and_each_stream_is_written_by_one_writer() -> None:
    writes = burst(GLOBEX, streams=3, updates=4, first_seq=0, first_stream=900, seed=1)
    assert len(writes) == 15 and not any(w.fails for w in writes)
    assert [w.stream_id[-3:] for w in writes[:4]] == ["900", "901", "902", "900"]
    assert [w.op for w in writes if w.stream_id.endswith("901")] == ["create"] + ["update"] * 4

    writes = plan(200, seed=1, tenants=TENANTS)
    parts = shard(writes, 4)
    assert sorted(w.seq for part in parts for w in part) == list(range(200))
    owner: dict[str, int] = {}
    for index, part in enumerate(parts):
        assert [w.seq for w in part] == sorted(w.seq for w in part)
        for w in part:
            assert owner.setdefault(w.stream_id, index) == index


def test_percentiles_nearest_rank() -> None:
    assert percentiles([]) is None
    p = percentiles([i / 1000 for i in range(1, 101)])  # 1 ms .. 100 ms
    assert p is not None
    assert (p.p50, p.p95, p.p99, p.count) == (50.0, 95.0, 99.0, 100)
    one = percentiles([-0.001])  # receipt noted just before the commit time: clamped
    assert one is not None and one.p99 == 0.0
