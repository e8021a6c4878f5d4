"""A ``REDIS_URL`` naming one node of a real Redis Cluster (SPEC section 16).

The gate's scripts run on the node that owns their keys, also after a slot migration
(MOVED) and a flushed script cache (NOSCRIPT), and fail open (counted) while their slot
migrates; two dispatcher processes share the retry limit with no fail-open, and the
service and ``status`` read the breaker from the right node; a node that goes down makes
the gate fail open, counted, while deliveries go on."""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
from aiohttp import web
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster as ClusterClient

from fluxora_webhooks.errors import ConfigError
from fluxora_webhooks.gate import AdmitRequest
from fluxora_webhooks.metrics import REGISTRY
from fluxora_webhooks.redis_connect import client_for
from fluxora_webhooks.redis_gate import (
    RedisGate,
    breaker_key,
    connect_gate,
    rate_limit_key,
    read_breaker_state,
)
from tests.e2e.test_protection import SKEW_S
from tests.support.chaos import stop_processes, tracebacks
from tests.support.dispatch import enqueue_many, pending, scalar, wait_until
from tests.support.procs import (
    command_env,
    dispatcher_env,
    free_port,
    run_command,
    start_dispatcher,
)
from tests.support.receiver import Receiver
from tests.support.redis_cluster import RedisCluster
from tests.support.scrape import scrape, total

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def fail_opens() -> float:
    return sum(
        REGISTRY.get_sample_value("fluxora_webhook_redis_fail_open_total", {"component": c}) or 0.0
        for c in ("gate", "ratelimit", "breaker")
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    nodes = RedisCluster(tmp_path_factory.mktemp("cluster"))
    try:
        nodes.start()
        yield nodes
    finally:
        nodes.stop()


@pytest_asyncio.fixture
async def cluster_client(cluster: RedisCluster) -> AsyncIterator[ClusterClient]:
    client = ClusterClient.from_url(cluster.url())
    try:
        yield client
    finally:
        await client.aclose()


async def _gate(url: str, prefix: str, **options: int) -> RedisGate:
    # No back-off after a failure: each call below must really try Redis.
    return await connect_gate(
        url,
        retry_rps=options.get("retry_rps", 3),
        breaker_threshold=options.get("breaker_threshold", 2),
        breaker_reset_ms=60_000,
        probe_ttl_ms=5_000,
        prefix=prefix,
        # A window longer than any test: what a test counts is all still in it however
        # slow a loaded machine is between the admissions and the reading.
        window_ms=options.get("window_ms", 600_000),
        timeout_ms=5_000,
        failure_backoff_ms=0,
    )


def consumer_urls(n: int) -> list[str]:
    return [f"https://consumer-{i}.example/hooks/{secrets.token_hex(4)}" for i in range(n)]


async def test_the_gate_runs_on_the_node_that_owns_each_consumers_keys(
    cluster: RedisCluster, cluster_client: ClusterClient
) -> None:
    prefix = f"t{secrets.token_hex(4)}:"
    urls = consumer_urls(24)
    owners = {cluster.owner(rate_limit_key(u, prefix)) for u in urls}
    assert len(owners) == 3  # the keys really are spread over the three masters
    before = fail_opens()
    gate = await _gate(cluster.url(), prefix)
    try:
        for url in urls:
            # A retry each time: the fourth within the window is refused by the shared limit.
            decided = [(await gate.admit(url, [2]))[0] for _ in range(4)]
            assert [d.allowed for d in decided] == [True, True, True, False], url
            await gate.report(url, [(decided[0], False), (decided[1], False)])
    finally:
        await gate.close()
    assert fail_opens() == before
    for url in urls:
        assert await cluster_client.zcard(rate_limit_key(url, prefix)) == 3
        # Two failures reached the threshold: the breaker opened, on the owning node.
        assert await cluster_client.hget(breaker_key(url, prefix), "state") == b"open"


async def test_a_batch_of_many_consumers_is_admitted_on_each_ones_node(
    cluster: RedisCluster, cluster_client: ClusterClient
) -> None:
    """admit_many on a cluster: each URL's keys on their own node (one call per URL)."""
    prefix = f"t{secrets.token_hex(4)}:"
    urls = consumer_urls(12)
    before = fail_opens()
    gate = await _gate(cluster.url(), prefix)
    try:
        decided = await gate.admit_many([AdmitRequest(u, [2, 2, 2, 2]) for u in urls])
    finally:
        await gate.close()
    assert fail_opens() == before
    assert [[a.allowed for a in d] for d in decided] == [[True, True, True, False]] * 12
    for url in urls:
        assert await cluster_client.zcard(rate_limit_key(url, prefix)) == 3


async def test_noscript_ask_and_moved(cluster: RedisCluster, cluster_client: ClusterClient) -> None:
    prefix = f"t{secrets.token_hex(4)}:"
    url = consumer_urls(1)[0]
    key = rate_limit_key(url, prefix)
    gate = await _gate(cluster.url(), prefix, retry_rps=1000, breaker_threshold=0)
    gate_client = client_for(cluster.url(), socket_timeout=2)
    before = fail_opens()
    try:
        assert (await gate.admit(url, [1]))[0].allowed

        # NOSCRIPT: every node forgot the scripts (a restart, SCRIPT FLUSH).
        for port in cluster.ports:
            cluster.client(port).script_flush()
        assert (await gate.admit(url, [1]))[0].allowed
        assert fail_opens() == before

        # The slot is being migrated and its keys already moved: a single-key read follows
        # the ASK redirection; a multi-key script cannot run anywhere until the migration
        # ends (Redis answers TRYAGAIN), so the gate fails open, counted, within its bound.
        await cluster_client.hset(breaker_key(url, prefix), mapping={"failures": 1})
        source = cluster.owner(key)
        target = next(p for p in cluster.ports if p != source)
        slot = int(cluster.client(source).execute_command("CLUSTER KEYSLOT", key))
        src, dst = cluster.client(source), cluster.client(target)
        dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", cluster.node_id(source))
        src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", cluster.node_id(target))
        for name in src.execute_command("CLUSTER GETKEYSINSLOT", slot, 100):
            src.migrate("127.0.0.1", target, name, 0, 5000)
        state = await read_breaker_state(gate_client, url, prefix)
        assert state.failures == 1
        assert (await gate.admit(url, [2]))[0].allowed
        assert fail_opens() == before + 1

        # MOVED: the migration ended; the gate's client still maps the slot to the source.
        for port in cluster.ports:
            cluster.client(port).execute_command(
                "CLUSTER SETSLOT", slot, "NODE", cluster.node_id(target)
            )
        assert cluster.owner(key) == target
        assert (await gate.admit(url, [1]))[0].allowed
        assert fail_opens() == before + 1
    finally:
        await gate.close()
        await gate_client.aclose()
    assert await cluster_client.zcard(key) == 3  # every attempt the gate saw was recorded
    assert cluster.client(target).exists(key)


async def test_a_cluster_url_with_another_database_is_a_configuration_error(
    cluster: RedisCluster,
) -> None:
    with pytest.raises(ConfigError) as caught:
        await _gate(cluster.url().replace("/0", "/3"), "p:")
    assert caught.value.variable == "REDIS_URL"
    assert "only database 0" in str(caught.value)


async def test_a_cluster_user_that_may_not_run_cluster_info_stops_start_up(
    cluster: RedisCluster,
) -> None:
    """docs/operations.md's ACL for a single Redis, on every node of a cluster: the node
    is taken for a single Redis, which answers MOVED for other nodes' slots, so start-up
    stops naming REDIS_URL and the commands to add, whichever slots its check's own keys
    fall in (each start a new try); with those commands added the gate starts."""
    user, password = f"fx{secrets.token_hex(3)}", secrets.token_hex(8)
    single = (
        "-@all", "+evalsha", "+script|load", "+ping", "+time", "+zremrangebyscore", "+zcard",
        "+zadd", "+pexpire", "+hmget", "+hset", "+del", "+get", "+set", "+pttl", "+hgetall",
    )  # fmt: skip
    keys = ("~webhook_rl:*", "~webhook_cb:*", "~webhook_cb_probe:*")

    async def set_user(*extra: str) -> None:
        for port in cluster.ports:
            node = Redis(host="127.0.0.1", port=port)  # this node only
            try:
                await node.execute_command(
                    "ACL", "SETUSER", user, "reset", "on", f">{password}", *keys, *single, *extra
                )
            finally:
                await node.aclose()

    url = cluster.url().replace("redis://", f"redis://{user}:{password}@")
    await set_user()
    for _ in range(10):
        with pytest.raises(ConfigError) as caught:
            await _gate(url, "")
        assert caught.value.variable == "REDIS_URL"
        assert "+cluster|info" in str(caught.value) and password not in str(caught.value)
    await set_user("+cluster|info", "+cluster|slots", "+command")
    gate = await _gate(url, "")
    try:
        assert (await gate.admit(consumer_urls(1)[0], [2]))[0].allowed
    finally:
        await gate.close()


async def test_run_with_workers_stops_on_a_cluster_url_with_another_database(
    cluster: RedisCluster, database_url: str, tmp_path: Path
) -> None:
    """The same mistake under a supervisor (each worker refuses it as it starts): `run`
    stops with exit 2 naming REDIS_URL, rather than starting its workers again forever."""
    env = dispatcher_env(
        database_url,
        cluster.url().replace("/0", "/3"),
        "http://127.0.0.1:9/unused",
        "p:",
        WEBHOOK_WORKERS="2",
    )
    log = tmp_path / "run.log"
    with log.open("wb") as sink:
        proc = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "fluxora_webhooks", "run"),
            env=env,
            stdout=sink,
            stderr=asyncio.subprocess.STDOUT,
        )
    try:
        code = await asyncio.wait_for(proc.wait(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    out = log.read_text()
    assert code == 2, out
    assert "REDIS_URL" in out and "only database 0" in out
    assert "stopped at start-up with a configuration error; stopping" in out
    assert "starting another in" not in out and "Traceback" not in out


async def test_a_slot_in_trouble_leaves_the_other_nodes_consumers_protected(
    cluster: RedisCluster, cluster_client: ClusterClient
) -> None:
    """A gate call that one node refuses (its consumer's slot is being migrated, so Redis
    refuses the script) fails open for that slot only: a consumer whose keys live on
    another node, or on the same node in another slot, keeps its retry limit, back-off or
    not."""
    prefix = f"t{secrets.token_hex(4)}:"
    urls = consumer_urls(24)
    troubled = urls[0]
    key = rate_limit_key(troubled, prefix)
    source = cluster.owner(key)
    healthy = next(u for u in urls if cluster.owner(rate_limit_key(u, prefix)) != source)
    neighbour = next(u for u in urls[1:] if cluster.owner(rate_limit_key(u, prefix)) == source)
    target = next(p for p in cluster.ports if p not in (source,))
    gate = await connect_gate(
        cluster.url(), retry_rps=2, breaker_threshold=2, breaker_reset_ms=60_000,
        probe_ttl_ms=5_000, prefix=prefix, window_ms=600_000, timeout_ms=5_000,
        failure_backoff_ms=600_000,  # a failure would keep its Redis skipped all test long
    )  # fmt: skip
    src, dst = cluster.client(source), cluster.client(target)
    slot = int(src.execute_command("CLUSTER KEYSLOT", key))
    try:
        assert (await gate.admit(troubled, [1]))[0].allowed
        await cluster_client.hset(breaker_key(troubled, prefix), mapping={"failures": 1})
        dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", cluster.node_id(source))
        src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", cluster.node_id(target))
        for name in src.execute_command("CLUSTER GETKEYSINSLOT", slot, 100):
            src.migrate("127.0.0.1", target, name, 0, 5000)
        before = fail_opens()
        assert (await gate.admit(troubled, [2]))[0].allowed  # refused by Redis: fails open
        assert fail_opens() == before + 1
        for other in (healthy, neighbour):  # the limit still holds for both
            decided = [(await gate.admit(other, [2]))[0].allowed for _ in range(3)]
            assert decided == [True, True, False], other
        assert fail_opens() == before + 1
        assert not gate.available  # one node's calls fail
    finally:
        for port in cluster.ports:
            cluster.client(port).execute_command(
                "CLUSTER SETSLOT", slot, "NODE", cluster.node_id(target)
            )
        await gate.close()


async def test_a_wrong_cluster_url_found_out_late_is_logged_as_a_configuration_error(
    cluster: RedisCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """A cluster URL naming database 3 whose node did not answer at start-up (so start-up
    could not refuse it): when the node answers, the gate says the URL is wrong, once, as
    an error naming REDIS_URL, rather than logging an outage that never ends."""
    client = client_for(cluster.url().replace("/0", "/3"), socket_timeout=2)
    gate = RedisGate(
        client, retry_rps=2, breaker_threshold=2, breaker_reset_ms=60_000, probe_ttl_ms=5_000,
        failure_backoff_ms=0,
    )  # fmt: skip
    url = consumer_urls(1)[0]
    try:
        with caplog.at_level("INFO", logger="fluxora_webhooks.redis_gate"):
            for _ in range(3):
                assert (await gate.admit(url, [2]))[0].allowed  # fails open
    finally:
        await gate.close()
        await client.aclose()
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.name.startswith("flux")]
    assert [level for level, _ in said] == ["ERROR"], said
    assert "REDIS_URL" in said[0][1] and "only database 0" in said[0][1]


def _other_node(cluster: RedisCluster, key: str) -> int:
    """A node that does not own ``key``: a client that ignored MOVED would fail open."""
    owner = cluster.owner(key)
    return next(p for p in cluster.ports if p != owner)


async def test_two_dispatchers_share_the_retry_limit_through_the_cluster(
    cluster: RedisCluster,
    database_url: str,
    redis_prefix: str,
    receiver: Receiver,
    tmp_path: Path,
) -> None:
    rps, events = 5, 12
    receiver.respond = lambda r: web.Response(status=503 if r.attempt <= 2 else 200)
    redis_url = cluster.url(_other_node(cluster, rate_limit_key(receiver.url, redis_prefix)))
    ports = [free_port(), free_port()]
    settings = {
        "WEBHOOK_RETRY_RPS": str(rps), "WEBHOOK_RETRY_SCHEDULE": "50ms",
        "WEBHOOK_MAX_ATTEMPTS": "3", "WEBHOOK_BATCH_SIZE": "5", "WEBHOOK_CLAIM_LOOPS": "2",
        "WEBHOOK_POLL_INTERVAL_MS": "100",
        # On, and never reached: the service reads the breaker's state from the cluster.
        "WEBHOOK_CIRCUIT_BREAKER_THRESHOLD": "1000",
    }  # fmt: skip
    await enqueue_many(database_url, events)
    procs = []
    try:
        for i, port in enumerate(ports):
            env = dispatcher_env(
                database_url, redis_url, receiver.url, redis_prefix,
                WEBHOOK_METRICS_PORT=str(port), **settings,
            )  # fmt: skip
            procs.append(await start_dispatcher(env, tmp_path / f"dispatcher-{i}.log"))
        await wait_until(lambda: _drained(database_url), timeout=60, what="all delivered")
        scraped = [await scrape(port) for port in ports]
        code, out = await run_command(
            "status", "--json",
            env=command_env(
                DATABASE_URL=database_url, REDIS_URL=redis_url, WEBHOOK_URL=receiver.url,
                FLUXORA_REDIS_PREFIX=redis_prefix, WEBHOOK_CIRCUIT_BREAKER_THRESHOLD="1000",
            ),
        )  # fmt: skip
    finally:
        codes = await stop_processes(procs)
    logs = [p.log() for p in procs]
    assert codes == [0, 0], logs

    retries = sorted(r.at for r in receiver.received if r.attempt > 1)
    assert len(retries) == 2 * events
    # Never more than WEBHOOK_RETRY_RPS retries in one second, across both processes.
    for i in range(len(retries) - rps):
        assert retries[i + rps] - retries[i] >= 1 - SKEW_S, retries[i : i + rps + 1]
    assert await scalar(database_url, "SELECT sum(deferrals) FROM webhook_outbox") > 0
    assert await scalar(database_url, "SELECT count(*) FROM webhook_dead_letter") == 0
    for samples in scraped:
        assert total(samples, "fluxora_webhook_redis_fail_open_total") == 0
        assert total(samples, "fluxora_webhook_deliveries_total", outcome="deferred") >= 0
        state = "fluxora_webhook_circuit_breaker_state"
        assert total(samples, state, state="closed") == 1, "breaker state not read"
    assert sum(total(s, "fluxora_webhook_rate_limit_deferrals_total") for s in scraped) > 0
    assert code == 0, out
    consumer = json.loads(out)["consumer"]
    assert consumer["redis"]["reachable"] is True, consumer
    assert consumer["breaker"]["state"] == "closed"
    assert all("Redis unavailable" not in log for log in logs), logs


async def test_a_node_down_fails_open_counted_while_deliveries_go_on(
    cluster: RedisCluster,
    database_url: str,
    redis_prefix: str,
    receiver: Receiver,
    tmp_path: Path,
) -> None:
    """Last in this module: it stops one of the cluster's nodes."""
    owner = cluster.owner(rate_limit_key(receiver.url, redis_prefix))
    port = free_port()
    env = dispatcher_env(
        database_url, cluster.url(_other_node(cluster, rate_limit_key(receiver.url, redis_prefix))),
        receiver.url, redis_prefix, WEBHOOK_METRICS_PORT=str(port),
        WEBHOOK_BATCH_SIZE="5", WEBHOOK_CLAIM_LOOPS="2", WEBHOOK_POLL_INTERVAL_MS="100",
        WEBHOOK_CIRCUIT_BREAKER_THRESHOLD="5",
    )  # fmt: skip
    proc = await start_dispatcher(env, tmp_path / "dispatcher.log")
    try:
        await enqueue_many(database_url, 20)
        await receiver.wait_for(20, timeout=30)
        assert total(await scrape(port), "fluxora_webhook_redis_fail_open_total") == 0

        cluster.stop_node(owner)  # the node that holds this consumer's keys
        await enqueue_many(database_url, 50)
        await receiver.wait_for(70, timeout=30)
        await wait_until(lambda: _drained(database_url), what="drained with a node down")
        assert total(await scrape(port), "fluxora_webhook_redis_fail_open_total") > 0
    finally:
        (code,) = await stop_processes([proc])
    assert code == 0, proc.log()
    assert "Redis unavailable" in proc.log()
    assert tracebacks(proc.log()) == 0, proc.log()
    assert len({r.delivery_id for r in receiver.received}) == 70
    assert await scalar(database_url, "SELECT count(*) FROM webhook_dead_letter") == 0


async def _drained(database_url: str) -> bool:
    return await pending(database_url) == 0


async def test_a_cluster_that_is_down_holds_no_batch_past_the_call_that_found_it(
    cluster: RedisCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """After the test above stopped a master (stopped here if run alone), the cluster is
    down: the live nodes answer PING but refuse every key (CLUSTERDOWN). A consumer whose
    keys are on a live node waits the gate's bound once; after that, each call goes ahead
    without the gate at once while the node is tried again in the background, and its
    outage is said once (a PING would have taken it as back: the next call waited the
    bound again, and the log said "unavailable" and "answers again" in turn)."""
    import logging

    caplog.set_level(logging.INFO, logger="fluxora_webhooks.redis_gate")
    live = [p for p in cluster.ports if cluster.procs[p].poll() is None]
    if len(live) == len(cluster.ports):
        cluster.stop_node(live.pop())
    asked = cluster.client(live[0])  # cluster.owner asks the first port, maybe the stopped one

    def owner(key: str) -> int:
        slot = int(asked.execute_command("CLUSTER KEYSLOT", key))
        for start, end, master, *_ in asked.execute_command("CLUSTER SLOTS"):
            if int(start) <= slot <= int(end):
                return int(master[1])
        raise AssertionError(f"no node serves slot {slot}")

    prefix = f"t{secrets.token_hex(4)}:"
    url = next(u for u in consumer_urls(50) if owner(rate_limit_key(u, prefix)) in live)
    node = f"127.0.0.1:{owner(rate_limit_key(url, prefix))}"

    def down() -> bool:
        return bool(asked.cluster("INFO").get("cluster_state") == "fail")

    await wait_until(lambda: asyncio.to_thread(down), 30, "the cluster down")
    gate = await connect_gate(
        cluster.url(live[0]), retry_rps=3, breaker_threshold=2, breaker_reset_ms=60_000,
        probe_ttl_ms=5_000, prefix=prefix, timeout_ms=3_000, failure_backoff_ms=100,
    )  # fmt: skip
    try:
        async with asyncio.timeout(10):
            assert [a.allowed for a in await gate.admit(url, [2])] == [True]  # the bound
        for _ in range(8):
            await asyncio.sleep(0.15)  # past the back-off: a try in the background
            async with asyncio.timeout(1.5):  # far under the 3 s bound
                assert [a.allowed for a in await gate.admit(url, [2])] == [True]
    finally:
        await gate.close()
    said = [r.getMessage() for r in caplog.records if r.name == "fluxora_webhooks.redis_gate"]
    assert len([m for m in said if f"Redis unavailable at {node}" in m]) == 1, said
    assert not [m for m in said if f"answers again at {node}" in m], said
