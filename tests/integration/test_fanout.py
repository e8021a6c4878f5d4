"""Fan-out (SPEC 10): one event reaches every enabled endpoint of its tenant whose filter
matches, each delivery with its own id and the endpoint's own secret; no other tenant's
endpoint ever sees it; the built-in default endpoint receives its tenant's events beside
them; an event no endpoint subscribes to is recorded as unrouted."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import ipaddress
import json
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
import pytest_asyncio
from standardwebhooks import Webhook

from fluxora_webhooks import deadletters, endpoints, enqueue, ops, outbox, verify
from fluxora_webhooks.metrics import REGISTRY
from fluxora_webhooks.settings import Settings
from fluxora_webhooks.targets import Targets
from tests.support.dispatch import SECRET, make_settings, rows, running_dispatcher, wait_until
from tests.support.receiver import Receiver

pytestmark = pytest.mark.integration

LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"),)
# The fan-out of events of the stream 'poison' is rejected (rejecting(..., "INSERT", ...)).
POISON_FAN_OUT = "NEW.event_id IS NOT NULL AND NEW.stream_id = 'poison'"


@pytest_asyncio.fixture
async def receivers() -> AsyncIterator[list[Receiver]]:
    started = [Receiver() for _ in range(5)]
    for r in started:
        await r.start()
    try:
        yield started
    finally:
        for r in started:
            await r.stop()


def settings_for(default: Receiver | None, **overrides: Any) -> Settings:
    base = make_settings(default.url if default else "", allowed_networks=LOOPBACK)
    if default is None:
        base = dataclasses.replace(base, secret=b"")
    return dataclasses.replace(base, **overrides)


async def add(conn: psycopg.AsyncConnection[Any], r: Receiver, **kw: Any) -> tuple[str, str]:
    endpoint, secret = await endpoints.create(conn, url=r.url, allowed_networks=LOOPBACK, **kw)
    return endpoint.id, secret


async def test_the_fan_out_matrix(database_url: str, receivers: list[Receiver]) -> None:
    default, a_all, a_stream, b_exact, b_other = receivers
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        ep_a_all, secret_a_all = await add(conn, a_all, tenant="acme")
        ep_a_stream, secret_a_stream = await add(
            conn, a_stream, tenant="acme", event_types=["stream.*"]
        )
        ep_b_exact, secret_b = await add(conn, b_exact, tenant="bolt", event_types=["invoice.paid"])
        await add(conn, b_other, tenant="bolt", event_types=["nothing.*"])
        async with conn.transaction():
            await enqueue(
                conn, tenant="acme", stream_id="s1", event_type="stream.created", payload={"n": 1}
            )
            await enqueue(
                conn, tenant="acme", stream_id="s1", event_type="invoice.paid", payload={"n": 2}
            )
            await enqueue(
                conn, tenant="bolt", stream_id="s2", event_type="invoice.paid", payload={"n": 3}
            )
            await enqueue(
                conn, tenant="bolt", stream_id="s2", event_type="stream.created", payload={"n": 4}
            )
            await enqueue(conn, stream_id="s3", event_type="stream.created", payload={"n": 5})
    async with running_dispatcher(settings_for(default), database_url):
        await wait_until(lambda: _settled(database_url), what="all delivered")

    def got(r: Receiver) -> list[int]:
        import json

        return sorted(json.loads(x.body)["n"] for x in r.received)

    assert got(a_all) == [1, 2]
    assert got(a_stream) == [1]
    assert got(b_exact) == [3]
    assert got(b_other) == []
    assert got(default) == [5]  # the default tenant's events only
    # Each (event, endpoint) pair has its own delivery id.
    ids = [x.delivery_id for r in receivers for x in r.received]
    assert len(ids) == len(set(ids)) == 5
    # Each endpoint's own secret signs: both schemes, and the standardwebhooks package.
    for r, secret in ((a_all, secret_a_all), (a_stream, secret_a_stream), (b_exact, secret_b)):
        for hit in r.received:
            assert verify(hit.body, hit.headers, secret) == hit.delivery_id
            assert verify(hit.body, hit.headers, secret, scheme="fluxora") == hit.delivery_id
            Webhook(secret).verify(hit.body, hit.headers)
    for hit in default.received:
        Webhook("whsec_" + base64.b64encode(SECRET).decode()).verify(hit.body, hit.headers)
    # The unrouted event (bolt's stream.created matches no bolt endpoint) is recorded.
    outcomes = dict(
        (n, o)
        for n, o in await rows(
            database_url,
            "SELECT (payload->>'n')::int, outcome FROM webhook_outbox WHERE event_id IS NULL",
        )
    )
    assert outcomes[4] == "unrouted"
    assert ep_a_all != ep_a_stream != ep_b_exact


async def test_an_event_without_a_default_endpoint_is_routed_and_recorded(
    database_url: str, receivers: list[Receiver]
) -> None:
    target = receivers[0]
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await add(conn, target)
        async with conn.transaction():
            await enqueue(conn, stream_id="s", event_type="stream.created", payload={})
            await enqueue(
                conn, tenant="nobody", stream_id="s", event_type="stream.created", payload={}
            )
    before = {o: _counted(o) for o in ("routed", "unrouted")}
    async with running_dispatcher(settings_for(None), database_url):
        await target.wait_for(1)
        await wait_until(lambda: _settled(database_url), what="settled")
    found = await rows(
        database_url,
        "SELECT tenant, outcome FROM webhook_outbox WHERE event_id IS NULL ORDER BY tenant",
    )
    assert found == [("", "routed"), ("nobody", "unrouted")]
    # Counted apart (SPEC 10: visible, counted): a misspelt tenant shows in the metric and
    # in `status`, not among the routed events.
    assert {o: _counted(o) - n for o, n in before.items()} == {"routed": 1, "unrouted": 1}
    status = await ops.read_status(database_url, minutes=5, webhook_url=None, redis_url=None)
    assert status["recent"]["unrouted_events"] == 1


def _counted(outcome: str) -> float:
    return REGISTRY.get_sample_value("fluxora_webhook_deliveries_total", {"outcome": outcome}) or 0


async def test_an_endpoint_receives_only_events_enqueued_after_it_was_created(
    database_url: str, receivers: list[Receiver]
) -> None:
    target = receivers[0]
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await enqueue(conn, stream_id="s", event_type="stream.created", payload={"n": "before"})
        await add(conn, target)
        await enqueue(conn, stream_id="s", event_type="stream.created", payload={"n": "after"})
    async with running_dispatcher(settings_for(None), database_url):
        await target.wait_for(1)
        await wait_until(lambda: _settled(database_url), what="settled")
    assert [x.body for x in target.received] == [b'{"n": "after"}']


async def test_an_event_written_after_an_endpoint_was_created_reaches_it_whenever_begun(
    database_url: str, receivers: list[Receiver]
) -> None:
    """A request-long producer transaction (Django's ATOMIC_REQUESTS, a session per
    request) that began before the endpoint was created and wrote its event after: the
    event is enqueued when its INSERT ran, after the endpoint was created."""
    target = receivers[0]
    async with (
        await psycopg.AsyncConnection.connect(database_url) as producer,
        await psycopg.AsyncConnection.connect(database_url, autocommit=True) as admin,
    ):
        await producer.execute("SELECT 1")  # the transaction begins
        await add(admin, target)
        await admin.execute("SELECT pg_sleep(0.05)")
        await enqueue(producer, stream_id="s", event_type="stream.created", payload={"n": 1})
        await producer.commit()
    async with running_dispatcher(settings_for(None), database_url):
        await wait_until(lambda: _settled(database_url), what="settled")
    assert [x.body for x in target.received] == [b'{"n": 1}']


async def _settled(database_url: str) -> bool:
    [(pending,)] = await rows(
        database_url, "SELECT count(*) FROM webhook_outbox WHERE NOT processed"
    )
    return int(pending) == 0


@contextlib.asynccontextmanager
async def rejecting(database_url: str, event: str, condition: str) -> AsyncIterator[None]:
    """While open, the database rejects each outbox row ``event`` (INSERT or UPDATE) for
    which ``condition`` (PL/pgSQL, over NEW and OLD) holds: a row it cannot write."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "CREATE FUNCTION reject() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN IF "
            + condition
            + " THEN RAISE EXCEPTION 'rejected'; END IF; RETURN NEW; END $$"
        )
        await conn.execute(
            "CREATE TRIGGER reject BEFORE " + event + " ON webhook_outbox"
            " FOR EACH ROW EXECUTE FUNCTION reject()"
        )
    try:
        yield
    finally:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            await conn.execute("DROP TRIGGER reject ON webhook_outbox")
            await conn.execute("DROP FUNCTION reject()")


async def _xmins(database_url: str) -> dict[str, list[str]]:
    """The transaction that last wrote each row: the event row and its deliveries."""
    found = await rows(
        database_url,
        "SELECT xmin::text, COALESCE(endpoint_id, '(event)') FROM webhook_outbox ORDER BY id",
    )
    by_txn: dict[str, list[str]] = {}
    for txn, what in found:
        by_txn.setdefault(txn, []).append(what)
    return by_txn


@pytest.mark.parametrize(
    ("endpoints_n", "batch_size", "max_connections", "sent_by_routing"),
    [(3, 10, 100, 3), (5, 2, 100, 5), (5, 2, 3, 2)],
)
async def test_an_events_deliveries_are_sent_by_the_transaction_that_routes_it(
    database_url: str,
    receivers: list[Receiver],
    endpoints_n: int,
    batch_size: int,
    max_connections: int,
    sent_by_routing: int,
) -> None:
    """Routed and sent in one claim transaction (no second claim and commit per event): a
    batch of them, and more while the process has connections to spare beyond the batch's
    own (WEBHOOK_MAX_CONNECTIONS 3 and a batch of 2: one to spare, so a batch's worth); the
    rest are claimed after its commit like any other row."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        for r in receivers[:endpoints_n]:
            await add(conn, r, tenant="acme")
        await enqueue(conn, tenant="acme", stream_id="s", event_type="stream.created", payload={})
    settings = settings_for(
        None, claim_loops=1, batch_size=batch_size, max_connections=max_connections
    )
    async with running_dispatcher(settings, database_url):
        await wait_until(lambda: _settled(database_url), what="all delivered")
    assert all(len(r.received) == 1 for r in receivers[:endpoints_n])
    outcomes = await rows(
        database_url, "SELECT outcome, count(*) FROM webhook_outbox GROUP BY 1 ORDER BY 1"
    )
    assert outcomes == [("delivered", endpoints_n), ("routed", 1)]
    by_txn = await _xmins(database_url)
    routing = next(txn for txn, what in by_txn.items() if "(event)" in what)
    assert len(by_txn[routing]) == 1 + sent_by_routing
    assert sum(len(v) for v in by_txn.values()) == 1 + endpoints_n


async def test_a_routing_batch_rolled_back_after_its_requests_sends_the_same_delivery_ids(
    database_url: str, receivers: list[Receiver]
) -> None:
    """The batch that routed an event and sent its deliveries fails at its completion: the
    event is routed again, and each endpoint gets its delivery again under the same id (a
    repeat the consumer can tell), with one delivery row per endpoint in the end."""
    targets = receivers[:3]
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        # The first completion of a delivery row is rejected (a sequence: not rolled back).
        await conn.execute("CREATE SEQUENCE reject_once")
        for r in targets:
            await add(conn, r, tenant="acme")
        await enqueue(conn, tenant="acme", stream_id="s", event_type="stream.created", payload={})
    first = "NEW.processed AND NOT OLD.processed AND NEW.event_id IS NOT NULL"
    async with (
        rejecting(database_url, "UPDATE", first + " AND nextval('reject_once') = 1"),
        running_dispatcher(settings_for(None, claim_loops=1), database_url),
    ):
        await wait_until(lambda: _settled(database_url), what="all delivered")
        for r in targets:
            await r.wait_for(2)
    ids = [{hit.delivery_id for hit in r.received} for r in targets]
    assert [len(r.received) for r in targets] == [2, 2, 2]
    assert all(len(one) == 1 for one in ids)  # both requests under one id
    assert len(set().union(*ids)) == 3  # and one id per endpoint
    delivered = await rows(
        database_url,
        "SELECT delivery_id::text FROM webhook_outbox WHERE outcome = 'delivered' ORDER BY 1",
    )
    assert sorted(d for (d,) in delivered) == sorted(next(iter(one)) for one in ids)


async def test_an_event_whose_routing_is_rejected_costs_the_other_events_nothing(
    database_url: str, receivers: list[Receiver]
) -> None:
    """The database rejects one event's fan-out (a trigger here): the batch's events are
    routed again one by one; the others are delivered and the rejected one becomes a dead
    letter that names why, rather than being claimed and rejected for ever."""
    target = receivers[0]
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await add(conn, target, tenant="acme")
        async with conn.transaction():
            for stream in ("ok-1", "poison", "ok-2"):
                await enqueue(
                    conn, tenant="acme", stream_id=stream, event_type="e", payload={"s": stream}
                )
    async with (
        rejecting(database_url, "INSERT", POISON_FAN_OUT),
        running_dispatcher(settings_for(None, claim_loops=1), database_url),
    ):
        await wait_until(lambda: _settled(database_url), what="settled")
    assert sorted(json.loads(hit.body)["s"] for hit in target.received) == ["ok-1", "ok-2"]
    events = await rows(
        database_url,
        "SELECT stream_id, outcome FROM webhook_outbox WHERE event_id IS NULL ORDER BY stream_id",
    )
    assert events == [("ok-1", "routed"), ("ok-2", "routed"), ("poison", "dead_letter")]
    [(reason, error)] = await rows(
        database_url, "SELECT reason, last_error FROM webhook_dead_letter"
    )
    assert reason == "internal_error" and "database rejected" in error
    # Replayed once the cause is gone, it goes back as the tenant's event and is routed to
    # the tenant's endpoint (not to the default endpoint, which is another tenant's).
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        replayed, _, _ = await deadletters.replay_or_purge_on(conn, "replay", [], include_all=True)
    assert len(replayed) == 1
    async with running_dispatcher(settings_for(None, claim_loops=1), database_url):
        await target.wait_for(3)
        await wait_until(lambda: _settled(database_url), what="settled")
    assert sorted(json.loads(hit.body)["s"] for hit in target.received) == [
        "ok-1",
        "ok-2",
        "poison",
    ]


async def test_a_single_consumer_outbox_routes_nothing(
    database_url: str, receivers: list[Receiver], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the default endpoint only, every event row is that endpoint's delivery and
    there is nothing to route it to: no batch's completion carries a routing part (its
    statement's cost), and every event is delivered and recorded as before."""
    asked: list[list[int]] = []
    whole = outbox.complete_statement

    def spy(*args: Any, **kwargs: Any) -> tuple[str, list[Any]]:
        asked.append(list(kwargs.get("route", ())))
        return whole(*args, **kwargs)

    monkeypatch.setattr(outbox, "complete_statement", spy)
    default = receivers[0]
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        for n in range(5):
            await enqueue(conn, stream_id=f"s{n}", event_type="e", payload={"n": n})
    async with running_dispatcher(settings_for(default, batch_size=2), database_url):
        await default.wait_for(5)
        await wait_until(lambda: _settled(database_url), what="all recorded")
    assert asked and all(route == [] for route in asked), asked
    found = await rows(database_url, "SELECT outcome, endpoint_id FROM webhook_outbox")
    assert sorted(found) == [("delivered", "default")] * 5


async def test_an_event_of_a_tenant_not_known_to_the_dispatcher_yet_is_routed_all_the_same(
    database_url: str, receivers: list[Receiver], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dispatcher's cache of endpoints only decides whether a batch routes its events
    before its requests (and sends their deliveries itself); an endpoint it has not heard
    of yet still gets the event, routed by the batch's completion and sent after it."""
    monkeypatch.setattr(Targets, "routes_tenant", lambda self, tenant: False)
    targets = receivers[:2]
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        for r in targets:
            await add(conn, r, tenant="acme")
        await enqueue(conn, tenant="acme", stream_id="s", event_type="stream.created", payload={})
    async with running_dispatcher(settings_for(None, claim_loops=1), database_url):
        await wait_until(lambda: _settled(database_url), what="all delivered")
    assert [len(r.received) for r in targets] == [1, 1]
    by_txn = await _xmins(database_url)
    routing = next(txn for txn, what in by_txn.items() if "(event)" in what)
    assert by_txn[routing] == ["(event)"]  # routed there, sent by a later batch


async def test_a_rejected_routing_still_reaches_the_default_endpoint(
    database_url: str, receivers: list[Receiver]
) -> None:
    """The database rejects one default-tenant event's fan-out, so the batch's routing
    statement fails before anything was sent: the other events still reach both the
    default endpoint and the tenant's own one; the rejected event becomes a dead letter."""
    default, other = receivers[0], receivers[1]
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await add(conn, other)  # the default tenant's own endpoint, beside the default one
        async with conn.transaction():
            for stream in ("ok-1", "poison", "ok-2"):
                await enqueue(conn, stream_id=stream, event_type="e", payload={"s": stream})
    async with (
        rejecting(database_url, "INSERT", POISON_FAN_OUT),
        running_dispatcher(settings_for(default, claim_loops=1), database_url),
    ):
        await wait_until(lambda: _settled(database_url), what="settled")
    assert sorted(json.loads(hit.body)["s"] for hit in other.received) == ["ok-1", "ok-2"]
    assert sorted(json.loads(hit.body)["s"] for hit in default.received) == ["ok-1", "ok-2"]
    [(stream, reason)] = await rows(
        database_url, "SELECT stream_id, reason FROM webhook_dead_letter"
    )
    assert (stream, reason) == ("poison", "internal_error")


async def test_an_event_whose_own_outcome_is_rejected_still_fans_out(
    database_url: str, receivers: list[Receiver]
) -> None:
    """The database rejects recording the default endpoint's delivery of one event (its
    outcome, not its fan-out): that delivery becomes a dead letter, and the event still
    reaches the tenant's own endpoint."""
    default, other = receivers[0], receivers[1]
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await add(conn, other)
        async with conn.transaction():
            for stream in ("ok", "bad"):
                await enqueue(conn, stream_id=stream, event_type="e", payload={"s": stream})
    bad = "NEW.stream_id = 'bad' AND NEW.outcome = 'delivered' AND NEW.endpoint_id = 'default'"
    async with (
        rejecting(database_url, "UPDATE", bad),
        running_dispatcher(settings_for(default, claim_loops=1), database_url),
    ):
        await wait_until(lambda: _settled(database_url), what="settled")
        await other.wait_for(2)
    # The batch that sent them rolled back: each was sent again under its delivery id.
    by_stream: dict[str, set[str]] = {}
    for hit in other.received:
        by_stream.setdefault(json.loads(hit.body)["s"], set()).add(hit.delivery_id)
    assert sorted(by_stream) == ["bad", "ok"] and all(len(v) == 1 for v in by_stream.values())
    recorded = await rows(
        database_url,
        "SELECT stream_id FROM webhook_outbox WHERE endpoint_id NOT IN ('default')"
        " AND outcome = 'delivered' ORDER BY 1",
    )
    assert recorded == [("bad",), ("ok",)]
    [(stream, endpoint, reason)] = await rows(
        database_url, "SELECT stream_id, endpoint_id, reason FROM webhook_dead_letter"
    )
    assert (stream, endpoint, reason) == ("bad", "default", "internal_error")
