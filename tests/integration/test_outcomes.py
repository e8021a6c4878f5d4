"""SPEC section 4: what each response leads to, retries as new rows, dead letters."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

import psycopg
import pytest
from aiohttp import web

from fluxora_webhooks import deadletters, endpoints, metrics
from fluxora_webhooks.outbox import enqueue
from fluxora_webhooks.redis_gate import connect_gate
from fluxora_webhooks.retry import RetryPolicy
from tests.support.dispatch import make_settings, pending, rows, running_dispatcher, wait_until
from tests.support.receiver import Received, Receiver

pytestmark = pytest.mark.integration

FAST = RetryPolicy(max_attempts=3, schedule_ms=(30,), jitter=lambda: 0.0)


async def _enqueue(database_url: str, n: int = 1, event_type: str = "stream.updated") -> list[str]:
    ids = []
    async with await psycopg.AsyncConnection.connect(database_url) as conn, conn.transaction():
        for i in range(n):
            ids.append(
                await enqueue(conn, stream_id=f"s-{i}", event_type=event_type, payload={"i": i})
            )
    return ids


async def _idle(database_url: str) -> bool:
    return await pending(database_url) == 0


async def _history(database_url: str, delivery_id: str) -> list[tuple[Any, ...]]:
    return await rows(
        database_url,
        "SELECT attempt, processed, outcome, status_code, error IS NOT NULL"
        " FROM webhook_outbox WHERE delivery_id = %s ORDER BY attempt",
        (delivery_id,),
    )


async def test_5xx_retries_with_same_delivery_id_then_delivers(
    database_url: str, receiver: Receiver
) -> None:
    answers = iter([503, 500, 200])
    receiver.respond = lambda r: web.Response(status=next(answers))
    (delivery_id,) = await _enqueue(database_url)

    async with running_dispatcher(make_settings(receiver.url), database_url, policy=FAST):
        await receiver.wait_for(3)
        await wait_until(lambda: _idle(database_url), what="idle")

    assert [r.delivery_id for r in receiver.received] == [delivery_id] * 3
    assert [r.headers["webhook-id"] for r in receiver.received] == [delivery_id] * 3
    assert [r.attempt for r in receiver.received] == [1, 2, 3]
    assert len({r.body for r in receiver.received}) == 1  # byte-identical on every attempt
    assert await _history(database_url, delivery_id) == [
        (1, True, "retry", 503, True),
        (2, True, "retry", 500, True),
        (3, True, "delivered", 200, False),
    ]


async def test_exhausted_attempts_dead_letter_with_last_error(
    database_url: str, receiver: Receiver
) -> None:
    receiver.respond = lambda r: web.Response(status=502, text="upstream broke")
    (delivery_id,) = await _enqueue(database_url)

    async with running_dispatcher(make_settings(receiver.url), database_url, policy=FAST):
        await receiver.wait_for(3)
        await wait_until(lambda: _idle(database_url), what="idle")

    assert len(receiver.received) == 3
    (dead,) = await deadletters.list_dead(database_url)
    assert dead["delivery_id"] == delivery_id
    assert dead["attempts"] == 3
    assert dead["reason"] == "attempts_exhausted"
    assert dead["last_status"] == 502
    (full,) = await deadletters.show(database_url, delivery_id)
    assert json.loads(full["payload"]) == {"i": 0}
    assert full["last_response"] == "upstream broke"
    assert [h[2] for h in await _history(database_url, delivery_id)] == [
        "retry",
        "retry",
        "dead_letter",
    ]


@pytest.mark.parametrize("status", [400, 401, 404, 410, 422, 301, 302, 307, 308])
async def test_permanent_failures_dead_letter_at_once_and_redirects_are_not_followed(
    database_url: str, receiver: Receiver, status: int
) -> None:
    def respond(r: Received) -> web.Response:
        if status >= 400:
            return web.Response(status=status)
        return web.Response(status=status, headers={"Location": "http://127.0.0.1:1/elsewhere"})

    receiver.respond = respond
    (delivery_id,) = await _enqueue(database_url)
    async with running_dispatcher(make_settings(receiver.url), database_url, policy=FAST):
        await receiver.wait_for(1)
        await wait_until(lambda: _idle(database_url), what="idle")
    await asyncio.sleep(0.1)
    assert len(receiver.received) == 1
    (dead,) = await deadletters.list_dead(database_url)
    assert dead["delivery_id"] == delivery_id
    assert dead["reason"] == ("http_4xx" if status >= 400 else "http_3xx")
    assert dead["attempts"] == 1


@pytest.mark.parametrize("status", [408, 425, 429, 500, 503, 599])
async def test_retryable_statuses(database_url: str, receiver: Receiver, status: int) -> None:
    answers = iter([status, 204])
    receiver.respond = lambda r: web.Response(status=next(answers))
    await _enqueue(database_url)
    async with running_dispatcher(make_settings(receiver.url), database_url, policy=FAST):
        await receiver.wait_for(2)
        await wait_until(lambda: _idle(database_url), what="idle")
    assert await deadletters.list_dead(database_url) == []
    assert await rows(database_url, "SELECT outcome FROM webhook_outbox ORDER BY id") == [
        ("retry",),
        ("delivered",),
    ]


async def test_any_2xx_is_delivered_whatever_the_content_type(
    database_url: str, receiver: Receiver
) -> None:
    replies = iter(
        [
            web.Response(
                status=200, body=b"\x00\xffnot json", content_type="application/octet-stream"
            ),
            web.Response(status=202),
            web.Response(status=204),
            web.Response(status=299, text="odd but 2xx"),
        ]
    )
    receiver.respond = lambda r: next(replies)
    await _enqueue(database_url, 4)
    async with running_dispatcher(
        make_settings(receiver.url, batch_size=1, claim_loops=1), database_url, policy=FAST
    ):
        await receiver.wait_for(4)
        await wait_until(lambda: _idle(database_url), what="idle")
    outcomes = await rows(database_url, "SELECT outcome, count(*) FROM webhook_outbox GROUP BY 1")
    assert outcomes == [("delivered", 4)]


async def test_timeout_is_retried(database_url: str, receiver: Receiver) -> None:
    calls = 0

    async def respond(r: Received) -> web.Response:
        nonlocal calls
        calls += 1
        if calls == 1:
            await asyncio.sleep(2)
        return web.Response(status=200)

    receiver.respond = respond
    (delivery_id,) = await _enqueue(database_url)
    async with running_dispatcher(
        make_settings(receiver.url, timeout_ms=300), database_url, policy=FAST
    ):
        await receiver.wait_for(2)
        await wait_until(lambda: _idle(database_url), what="idle")
    history = await rows(
        database_url,
        "SELECT attempt, outcome, error FROM webhook_outbox"
        " WHERE delivery_id = %s ORDER BY attempt",
        (delivery_id,),
    )
    assert history == [(1, "retry", "timeout"), (2, "delivered", None)]


async def test_connection_refused_is_retried_then_dead_lettered(database_url: str) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/hook?token=abc"
    (delivery_id,) = await _enqueue(database_url)
    async with running_dispatcher(make_settings(url), database_url, policy=FAST):
        await wait_until(lambda: _idle(database_url), what="idle")
    (dead,) = await deadletters.list_dead(database_url)
    assert dead["delivery_id"] == delivery_id
    assert dead["reason"] == "attempts_exhausted" and dead["attempts"] == 3
    assert "connection failed" in dead["last_error"]
    assert "token" not in dead["last_error"]


async def test_retry_after_lengthens_the_delay_counted_from_the_response(
    database_url: str, receiver: Receiver
) -> None:
    answered: list[float] = []

    async def respond(r: Received) -> web.Response:
        if not answered:
            await asyncio.sleep(1.0)  # a slow answer: the delay counts from its end
            answered.append(time.time())
            return web.Response(status=429, headers={"Retry-After": "2"})
        return web.Response()

    receiver.respond = respond
    await _enqueue(database_url)
    async with running_dispatcher(make_settings(receiver.url), database_url, policy=FAST):
        await receiver.wait_for(2, timeout=15)
    second = receiver.received[1]
    # The 30 ms schedule was lengthened to 2 s, measured from the response, not the claim.
    assert second.at - answered[0] >= 1.95, second.at - answered[0]


async def test_replay_keeps_the_delivery_id(database_url: str, receiver: Receiver) -> None:
    receiver.respond = lambda r: web.Response(status=410)
    (delivery_id,) = await _enqueue(database_url)
    async with running_dispatcher(make_settings(receiver.url), database_url, policy=FAST):
        await receiver.wait_for(1)
        await wait_until(lambda: _idle(database_url), what="idle")
        receiver.respond = None  # the consumer is fixed
        assert await deadletters.replay(database_url, [delivery_id]) == [delivery_id]
        await receiver.wait_for(2)
        await wait_until(lambda: _idle(database_url), what="idle")
    assert [r.delivery_id for r in receiver.received] == [delivery_id, delivery_id]
    assert receiver.received[0].body == receiver.received[1].body
    assert await deadletters.list_dead(database_url) == []
    (replayed,) = await deadletters.list_dead(database_url, include_all=True)
    assert replayed["state"] == "replayed"


async def test_one_bad_row_does_not_block_the_others(database_url: str, receiver: Receiver) -> None:
    # A plain-SQL producer wrote an event type that cannot be sent as a header.
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload)"
            " VALUES ('s', 'ok.1', '{}'), ('s', e'bad\\r\\nx-evil: 1', '{}'), ('s', 'ok.2', '{}'),"
            # Not a line break, but no HTTP field may hold it either (a terminal escape).
            " ('s', e'bad\\x1b[2J', '{}')"
        )
    async with running_dispatcher(make_settings(receiver.url), database_url, policy=FAST):
        await receiver.wait_for(2)
        await wait_until(lambda: _idle(database_url), what="idle")
    assert sorted(r.headers["x-fluxora-event"] for r in receiver.received) == ["ok.1", "ok.2"]
    dead = await deadletters.list_dead(database_url)
    assert [d["reason"] for d in dead] == ["invalid_request", "invalid_request"]
    assert "x-evil" not in {k for r in receiver.received for k in r.headers}


async def test_large_response_body_is_truncated_not_an_error(
    database_url: str, receiver: Receiver
) -> None:
    receiver.respond = lambda r: web.Response(status=200, body=b"x" * 200_000)
    await _enqueue(database_url)
    async with running_dispatcher(
        make_settings(receiver.url, max_response_bytes=1000), database_url, policy=FAST
    ):
        await wait_until(lambda: _idle(database_url), what="idle")
    assert await rows(
        database_url, "SELECT outcome, length(response_body) FROM webhook_outbox"
    ) == [("delivered", 1000)]


async def test_waiting_for_a_connection_is_not_a_timeout(
    database_url: str, receiver: Receiver
) -> None:
    async def slow(r: Received) -> web.Response:
        await asyncio.sleep(0.3)
        return web.Response()

    receiver.respond = slow
    await _enqueue(database_url, 12)
    # 12 rows in one batch share 2 connections: 6 rounds of 0.3 s, each within the 1 s
    # timeout, although the last ones wait almost 2 s for their turn.
    settings = make_settings(
        receiver.url, batch_size=12, claim_loops=1, max_connections=2, timeout_ms=1000
    )
    async with running_dispatcher(settings, database_url, policy=FAST):
        await wait_until(lambda: _idle(database_url), timeout=30, what="idle")
    outcomes = await rows(database_url, "SELECT outcome, count(*) FROM webhook_outbox GROUP BY 1")
    assert outcomes == [("delivered", 12)]
    assert len(receiver.received) == 12


@pytest.mark.parametrize(
    ("table", "when", "status"),
    [
        # A batch with a dead letter: written under a savepoint.
        ("webhook_dead_letter", "BEFORE INSERT", 410),
        # An all-delivered batch (no savepoint): rolled back, relocked, recorded row by row.
        ("webhook_outbox", "BEFORE UPDATE", 200),
    ],
)
async def test_a_row_the_database_rejects_never_blocks_the_batch_nor_spins(
    database_url: str, receiver: Receiver, table: str, when: str, status: int
) -> None:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        # A row whose outcome the database refuses to record, whatever we try.
        await conn.execute(
            # Two branches: PL/pgSQL does not promise to short-circuit OR, and the dead
            # letter table has no `processed` column to read.
            "CREATE FUNCTION poison() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
            " IF NEW.stream_id <> 'poison' THEN RETURN NEW; END IF;"
            " IF TG_TABLE_NAME = 'webhook_dead_letter' THEN RAISE EXCEPTION 'rejected'; END IF;"
            " IF NEW.processed THEN RAISE EXCEPTION 'rejected'; END IF;"
            " RETURN NEW; END $$"
        )
        await conn.execute(
            f"CREATE TRIGGER poison {when} ON {table} FOR EACH ROW EXECUTE FUNCTION poison()"
        )
        await conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload)"
            " VALUES ('ok-1', 'e', '{}'), ('poison', 'e', '{}'), ('ok-2', 'e', '{}')"
        )
    (poison_id,) = [
        row[0]
        for row in await rows(
            database_url, "SELECT delivery_id::text FROM webhook_outbox WHERE stream_id='poison'"
        )
    ]

    async def respond(r: Received) -> web.Response:
        return web.Response(status=status if r.delivery_id == poison_id else 200)

    receiver.respond = respond
    settings = make_settings(receiver.url, claim_loops=1)
    async with running_dispatcher(settings, database_url, policy=FAST):
        await receiver.wait_for(3)
        await asyncio.sleep(1.0)  # a row left due would be re-sent over and over by now
    assert len(receiver.received) == 3
    got = await rows(
        database_url,
        "SELECT stream_id, processed, outcome, deferrals, created_at > now() + interval '50 s'"
        " FROM webhook_outbox ORDER BY stream_id",
    )
    assert got == [
        ("ok-1", True, "delivered", 0, False),
        ("ok-2", True, "delivered", 0, False),
        ("poison", False, None, 1, True),  # deferred a minute, nothing lost
    ]


async def test_a_batch_with_a_deferral_whose_statement_fails_is_recorded_row_by_row(
    database_url: str, redis_url: str, prefix: str, receiver: Receiver
) -> None:
    """A batch holding a deferred row is written without a savepoint too; when its
    statement fails, the delivered rows are not sent again and the deferral is kept."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "CREATE FUNCTION poison() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
            " IF NEW.stream_id = 'poison' AND NEW.processed THEN"
            " RAISE EXCEPTION 'rejected'; END IF; RETURN NEW; END $$"
        )
        await conn.execute(
            "CREATE TRIGGER poison BEFORE UPDATE ON webhook_outbox"
            " FOR EACH ROW EXECUTE FUNCTION poison()"
        )
        # Two retries (attempt 2) under a retry rate of 1 a second: the second is deferred
        # in the same batch as the first and the poisoned row.
        await conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload, attempt)"
            " VALUES ('ok-1', 'ok.1', '{}', 2), ('poison', 'poison', '{}', 1),"
            " ('ok-2', 'ok.2', '{}', 2)"
        )
    gate = await connect_gate(
        redis_url, retry_rps=1, breaker_threshold=0, breaker_reset_ms=1000,
        probe_ttl_ms=5000, prefix=prefix,
    )  # fmt: skip
    settings = make_settings(receiver.url, claim_loops=1, retry_rps=1)
    try:
        async with running_dispatcher(settings, database_url, gate=gate, policy=FAST):
            await receiver.wait_for(3, timeout=20)
            await asyncio.sleep(1.0)  # a row recorded twice would be sent again by now
    finally:
        await gate.close()
    sent = sorted(r.headers["x-fluxora-event"] for r in receiver.received)
    assert sent == ["ok.1", "ok.2", "poison"]
    got = await rows(
        database_url,
        "SELECT stream_id, processed, outcome, deferrals > 0, created_at > now() + interval '50 s'"
        " FROM webhook_outbox ORDER BY stream_id",
    )
    assert got == [
        ("ok-1", True, "delivered", False, False),
        ("ok-2", True, "delivered", True, False),  # deferred by the rate, then delivered
        ("poison", False, None, True, True),
    ]


async def test_a_batch_whose_recording_fails_twice_leaves_no_detached_request_waiting(
    database_url: str, receiver: Receiver
) -> None:
    """A batch with a request that outlived it (leased) whose commit is rejected, then
    whose row-by-row recording is rejected too: both transactions rolled back, so the
    lease was never written. The detached request is given up (its row is claimed and sent
    again), not left waiting for a commit that will never come: the dispatcher counts no
    detached request still outstanding, and the row is delivered."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        # Rejected at COMMIT (a deferred constraint trigger), the first two times the slow
        # row's lease is written; a sequence counts outside the rolled-back transactions.
        await conn.execute("CREATE SEQUENCE lease_faults")
        await conn.execute(
            "CREATE FUNCTION reject_lease() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
            " IF NEW.stream_id = 'slow' AND NEW.lease IS NOT NULL"
            " AND nextval('lease_faults') <= 2 THEN RAISE EXCEPTION 'rejected'; END IF;"
            " RETURN NEW; END $$"
        )
        await conn.execute(
            "CREATE CONSTRAINT TRIGGER reject_lease AFTER UPDATE ON webhook_outbox"
            " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION reject_lease()"
        )
    slow_id = await _slow_and_ok(database_url, receiver)
    settings = make_settings(receiver.url, claim_loops=1)
    async with running_dispatcher(settings, database_url, policy=FAST) as dispatcher:

        async def settled() -> bool:
            got = await rows(
                database_url, "SELECT outcome FROM webhook_outbox WHERE stream_id = 'slow'"
            )
            return got == [("delivered",)] and dispatcher.completer.outstanding == 0

        await wait_until(settled, what="the slow row delivered and nothing left outstanding")
        faults = await rows(database_url, "SELECT last_value FROM lease_faults")
    assert faults[0][0] >= 2  # both recordings were rejected
    # The first request's answer was given up (its lease never written): sent again.
    assert [r.delivery_id for r in receiver.received].count(slow_id) >= 2


async def _slow_and_ok(database_url: str, receiver: Receiver) -> str:
    """Two events, one answered after the batch's patience (its request is detached) and
    one at once. Returns the slow one's delivery id."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload)"
            " VALUES ('slow', 'e', '{}'), ('ok', 'e', '{}')"
        )
    slow_id = (
        await rows(
            database_url, "SELECT delivery_id::text FROM webhook_outbox WHERE stream_id='slow'"
        )
    )[0][0]

    async def respond(r: Received) -> web.Response:
        if r.delivery_id == slow_id:
            await asyncio.sleep(1.0)  # outlives the batch's patience: detached
        return web.Response(status=200)

    receiver.respond = respond
    return str(slow_id)


def _outcome_count(outcome: str) -> float:
    value = metrics.REGISTRY.get_sample_value(
        "fluxora_webhook_deliveries_total", {"outcome": outcome}
    )
    return value or 0.0


async def test_a_request_that_outlives_its_batch_is_counted_leased_once(
    database_url: str, receiver: Receiver
) -> None:
    """A consumer slower than the batch's patience: its request is detached, its row leased
    by the batch's commit and counted ``leased`` once (as operations.md says), then its
    attempt's outcome is counted when the completer records it."""
    slow_id = await _slow_and_ok(database_url, receiver)
    before = {o: _outcome_count(o) for o in ("leased", "delivered")}
    detached = metrics.REGISTRY.get_sample_value("fluxora_webhook_detached_requests_total") or 0
    settings = make_settings(receiver.url, claim_loops=1)
    async with running_dispatcher(settings, database_url, policy=FAST) as dispatcher:

        async def settled() -> bool:
            got = await rows(database_url, "SELECT outcome FROM webhook_outbox ORDER BY id")
            return got == [("delivered",)] * 2 and dispatcher.completer.outstanding == 0

        await wait_until(settled, what="both rows delivered, nothing outstanding")
    assert (metrics.REGISTRY.get_sample_value("fluxora_webhook_detached_requests_total") or 0) - (
        detached
    ) == 1
    assert {o: _outcome_count(o) - n for o, n in before.items()} == {"leased": 1, "delivered": 2}
    assert [r.delivery_id for r in receiver.received].count(slow_id) == 1


def _claim_errors() -> float:
    return metrics.REGISTRY.get_sample_value("fluxora_webhook_claim_errors_total") or 0.0


async def test_a_batch_that_fails_while_planning_gives_back_the_slots_it_reserved(
    database_url: str, receiver: Receiver
) -> None:
    """A batch reserves each row's slot of its endpoint's WEBHOOK_ENDPOINT_CONCURRENCY as it
    plans it. When a later row's planning fails (here: the registry cannot be read for a
    disabled endpoint's row), the batch rolls back and gives those slots back: however
    often it fails, the endpoint keeps its concurrency and its rows are delivered once
    the registry reads again."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        endpoint, _ = await endpoints.create(conn, url="https://example.com/h", tenant="acme")
        await endpoints.disable(conn, endpoint.id)
    settings = make_settings(receiver.url, claim_loops=1, endpoint_concurrency=4)
    async with running_dispatcher(settings, database_url, policy=FAST) as dispatcher:

        async def loaded() -> bool:  # the registry read (before it is made unreadable)
            return dispatcher.targets.get(endpoint.id) is not None

        await wait_until(loaded, what="the endpoints loaded")
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            # The registry's rows no longer read as endpoints.
            await conn.execute(
                "ALTER TABLE webhook_endpoints RENAME COLUMN description TO description_gone"
            )
            async with conn.transaction():
                # Three events for the default endpoint, planned first (each reserves a
                # slot), then a delivery of the disabled endpoint, read again from the
                # registry before it is parked: that fails, every time the batch is claimed.
                await conn.execute(
                    "INSERT INTO webhook_outbox (stream_id, event_type, payload)"
                    " SELECT 's' || g, 'e', '{}' FROM generate_series(1, 3) g"
                )
                await conn.execute(
                    "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload,"
                    " endpoint_id) VALUES ('acme', 'x', 'e', '{}', %s)",
                    (endpoint.id,),
                )
            errors = _claim_errors()

            async def failed_often() -> bool:
                return _claim_errors() >= errors + 3

            await wait_until(failed_often, what="the batch to fail three times")
            await conn.execute(
                "ALTER TABLE webhook_endpoints RENAME COLUMN description_gone TO description"
            )
        await receiver.wait_for(3)

        async def parked() -> bool:
            got = await rows(
                database_url,
                "SELECT hold FROM webhook_outbox WHERE endpoint_id = %s",
                (endpoint.id,),
            )
            return got == [("parked",)]

        await wait_until(parked, what="the disabled endpoint's delivery parked")
    assert len(receiver.received) == 3
