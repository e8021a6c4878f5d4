"""`fluxora-webhooks demo` as a newcomer runs it: on the embedded engines (first run and
reuse), on configured engines, after a crashed run, and where it must refuse to run."""

from __future__ import annotations

import asyncio
import re
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from fluxora_webhooks import deliveries, tokens
from fluxora_webhooks.demo import DemoOptions, run_demo
from fluxora_webhooks.demo.consumer import Consumer
from fluxora_webhooks.demo.runner import percentiles
from fluxora_webhooks.demo.streams import STREAM_PREFIX, plan, shard
from fluxora_webhooks.embedded import EmbeddedEngines, stop_embedded
from fluxora_webhooks.errors import VerificationError
from tests.support.dispatch import scalar
from tests.support.procs import command_env, run_command

DEMO = ("demo", "--events", "60", "--no-live")


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


def committed_count(output: str) -> int:
    match = re.search(r"stream writes committed\D+(\d+)", output)
    assert match, output
    return int(match.group(1))


def assert_succeeded(code: int, output: str) -> int:
    """The run exited 0 with a summary that says every committed event was delivered."""
    assert code == 0, output
    assert "Summary" in output
    assert "Latency from commit to receipt" in output
    assert "OK: every committed event was delivered" in output
    committed = committed_count(output)
    assert 0 < committed < 60  # a few of the 60 writes roll back
    assert re.search(rf"delivered, signatures verified\D+{committed}/{committed}\b", output)
    assert re.search(r"received from rolled-back writes\D+0\b", output)
    assert re.search(r"dead letters\D+0\b", output)
    assert re.search(r"signature failures\D+0\b", output)
    assert "FAILED" not in output
    return committed


@pytest.mark.e2e
@pytest.mark.slow
async def test_demo_runs_twice_on_the_embedded_engines(demo_home: Path) -> None:
    env = command_env(FLUXORA_HOME=str(demo_home))
    first = await run_command(*DEMO, env=env, timeout=120)
    assert_succeeded(*first)
    assert "Running on the embedded PostgreSQL and Redis" in first[1]
    assert (demo_home / "postgres" / "PG_VERSION").exists()

    second = await run_command(*DEMO, env=env, timeout=60)
    assert_succeeded(*second)
    assert "First run" not in second[1]  # the data folder was reused
    # The same seed plans the same writes, so both runs committed the same number.
    assert committed_count(second[1]) == committed_count(first[1])


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
            while not re.search(r"written [1-9]\d*/5000 · delivered [1-9]", "".join(seen[-1:])):
                line = await proc.stdout.readline()
                assert line, "the demo ended before it was killed:\n" + "".join(seen)
                seen.append(line.decode())
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
    assert proc.returncode == -signal.SIGKILL

    # The killed run left its writes and events behind.
    with EmbeddedEngines(demo_home) as engines:
        database_url = engines.database_url()
        assert await scalar(database_url, "SELECT count(*) FROM demo_streams") > 0
        left = await scalar(
            database_url,
            "SELECT count(*) FROM webhook_outbox WHERE starts_with(stream_id, %s)",
            (STREAM_PREFIX,),
        )
        assert left > 0

    assert_succeeded(*await run_command(*DEMO, env=env, timeout=60))


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
    code, output = await run_command(*DEMO, env=env, timeout=60)
    committed = assert_succeeded(code, output)
    assert "embedded" not in output
    assert not (tmp_path / "unused").exists()

    # The database agrees with the summary, independently of the demo's own checks.
    delivered = await scalar(
        database_url,
        "SELECT count(DISTINCT delivery_id) FROM webhook_outbox WHERE outcome = 'delivered'",
    )
    assert delivered == committed
    assert await scalar(database_url, "SELECT count(*) FROM webhook_dead_letter") == 0
    assert (
        await scalar(database_url, "SELECT count(*) FROM webhook_outbox WHERE NOT processed") == 0
    )
    retried = await scalar(
        database_url, "SELECT count(*) FROM webhook_outbox WHERE attempt > 1 AND processed"
    )
    assert retried == committed // 7  # the consumer refuses every 7th first attempt

    # The dashboard was started and named, with an admin token that works (not kept
    # running: the output is not a terminal).
    assert re.search(r"Dashboard: http://127\.0\.0\.1:\d+/", output), output
    token = re.search(r"Admin token \(shown once\): (fxa_\S+)", output)
    assert token and "Not kept running" in output
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        principal = await tokens.authenticate(conn, token.group(1))
        assert principal is not None and principal.admin
        shown, _ = await deliveries.list_deliveries(conn, status="delivered", limit=1000)
    assert len(shown) == committed


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
async def test_demo_help_and_bad_options() -> None:
    code, output = await run_command("demo", "--help", env=command_env(), timeout=30)
    assert code == 0, output
    for option in ("--events", "--seed", "--no-live", "--timeout"):
        assert option in output
    code, output = await run_command("demo", "--events", "0", env=command_env(), timeout=30)
    assert code == 2, output
    assert "--events" in output


def test_the_plan_is_deterministic_and_rolls_some_writes_back() -> None:
    writes = plan(300, seed=7)
    assert writes == plan(300, seed=7)
    assert writes != plan(300, seed=8)
    assert {w.op for w in writes} == {"create", "update", "pause", "cancel"}
    assert 10 <= sum(w.fails for w in writes) <= 20
    # Nothing happens to a stream after its committed cancel, or before its committed create.
    created: set[str] = set()
    cancelled: set[str] = set()
    for w in writes:
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


def test_each_stream_is_written_by_one_writer_in_order() -> None:
    writes = plan(200, seed=1)
    parts = shard(writes, 4)
    assert sorted(w.seq for part in parts for w in part) == list(range(200))
    owner: dict[str, int] = {}
    for index, part in enumerate(parts):
        assert [w.seq for w in part] == sorted(w.seq for w in part)
        for w in part:
            assert owner.setdefault(w.stream_id, index) == index


@pytest.mark.integration
async def test_the_verdict_catches_what_breaks_the_guarantees(
    database_url: str, redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A consumer that rejects some signatures: the demo must not report success."""
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
        DemoOptions(events=40, rate=0, timeout_s=4, redis_prefix=redis_prefix),
        database_url=database_url,
        redis_url=redis_url,
    )
    assert not report.ok
    failures = report.snapshot.signature_failures
    assert failures >= 1
    # 401 is a permanent failure: each rejected event is dead-lettered, never delivered.
    assert report.dead_letters == failures
    assert report.missing >= failures  # (and a retry may still have been on its way)
    assert report.snapshot.delivered == report.snapshot.committed - report.missing
    text = "\n".join(report.problems)
    assert f"{failures} request(s) failed signature verification" in text
    assert f"{failures} event(s) were dead-lettered" in text
    assert f"{report.missing} committed event(s) were not delivered" in text
    assert "timed out after 4 s" in text


def test_percentiles_nearest_rank() -> None:
    assert percentiles([]) is None
    p = percentiles([i / 1000 for i in range(1, 101)])  # 1 ms .. 100 ms
    assert p is not None
    assert (p.p50, p.p95, p.p99, p.count) == (50.0, 95.0, 99.0, 100)
    one = percentiles([-0.001])  # receipt noted just before the commit time: clamped
    assert one is not None and one.p99 == 0.0
