"""Events, deliveries, replay, recovery and statistics over the API (SPEC 15), delivered
for real: events enqueued over HTTP reach loopback receivers through a running dispatcher;
a replay keeps the delivery id (whatever the delivery's status); recovery re-queues an
endpoint's dead letters; lists page through more rows than a page."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
import pytest_asyncio
from aiohttp import web

from fluxora_webhooks import deadletters, deliveries, endpoints
from tests.support.api import LOOPBACK, Api
from tests.support.dispatch import make_settings, running_dispatcher, wait_until
from tests.support.receiver import Received, Receiver, answering

pytestmark = pytest.mark.integration


@pytest_asyncio.fixture
async def failing() -> AsyncIterator[Receiver]:
    """A consumer that refuses for good (400) with markup in its body, until told."""
    async with answering(400, "<b>refused</b>") as recv:
        yield recv


def dispatcher_settings(**overrides: Any) -> Any:
    base = make_settings("", allowed_networks=LOOPBACK, secret=b"")
    return dataclasses.replace(base, **overrides)


async def add_endpoint(api: Api, url: str, tenant: str, **extra: Any) -> str:
    reply = await api.post("/api/v1/endpoints", json={"url": url, "tenant": tenant, **extra})
    assert reply.status == 201, reply.text
    return str(reply.body["id"])


async def delivery(api: Api, delivery_id: str) -> dict[str, Any]:
    reply = await api.get(f"/api/v1/deliveries/{delivery_id}")
    assert reply.status == 200, reply.text
    body: dict[str, Any] = reply.body
    return body


async def test_enqueue_over_http_delivered_then_replayed_and_recovered(
    api: Api, database_url: str, receiver: Receiver, failing: Receiver
) -> None:
    good = await add_endpoint(api, receiver.url, "acme")
    bad = await add_endpoint(api, failing.url, "acme")
    accepted = await api.post(
        "/api/v1/events",
        token="acme",
        json={"stream_id": "s-1", "event_type": "invoice.paid", "payload": {"n": 1}},
    )
    assert accepted.status == 202, accepted.text
    event_id = accepted.body["id"]
    assert accepted.body["tenant"] == "acme" and accepted.body["payload"] == {"n": 1}

    async with running_dispatcher(dispatcher_settings(), database_url):
        await receiver.wait_for(1)
        await failing.wait_for(1)

        async def settled() -> bool:
            event = (await api.get(f"/api/v1/events/{event_id}")).body
            return {d["status"] for d in event["deliveries"]} == {"delivered", "dead_letter"}

        await wait_until(settled, what="both deliveries finished")
        event = (await api.get(f"/api/v1/events/{event_id}")).body
        by_endpoint = {d["endpoint_id"]: d for d in event["deliveries"]}
        assert set(by_endpoint) == {good, bad}
        delivered_id = by_endpoint[good]["delivery_id"]
        dead_id = by_endpoint[bad]["delivery_id"]
        assert receiver.received[0].delivery_id == delivered_id

        shown = await delivery(api, delivered_id)
        assert shown["status"] == "delivered" and shown["attempt_count"] == 1
        assert shown["event_id"] == event_id and shown["payload"] == {"n": 1}
        (first,) = shown["attempts"]
        assert first["status_code"] == 200 and first["response_body"] == "ok"
        assert first["duration_ms"] > 0 and first["at"] and first["error"] is None
        dead = await delivery(api, dead_id)
        assert dead["status"] == "dead_letter"
        assert dead["attempts"][0]["status_code"] == 400
        assert dead["attempts"][0]["response_body"] == "<b>refused</b>"

        # Replay a delivered delivery: the same delivery id again, a new attempt.
        replayed = await api.post(f"/api/v1/deliveries/{delivered_id}/replay")
        assert replayed.status == 202 and replayed.body["delivery_id"] == delivered_id
        await receiver.wait_for(2)
        assert receiver.received[1].delivery_id == delivered_id

        async def two_attempts() -> bool:
            return bool((await delivery(api, delivered_id))["attempt_count"] == 2)

        await wait_until(two_attempts, what="the replay recorded")
        again = await delivery(api, delivered_id)
        assert again["status"] == "delivered" and again["attempts"][1]["replay"] is True

        # Recover the dead letter once the consumer is fixed: same delivery id.
        failing.respond = None
        recovered = await api.post(f"/api/v1/endpoints/{bad}/recover", json={"since": "1h"})
        assert recovered.status == 200 and recovered.body == {"requeued": 1}
        await failing.wait_for(2)
        assert failing.received[1].delivery_id == dead_id

        async def recovered_delivered() -> bool:
            return bool((await delivery(api, dead_id))["status"] == "delivered")

        await wait_until(recovered_delivered, what="the recovered delivery delivered")
        nothing = await api.post(f"/api/v1/endpoints/{bad}/recover", json={"since": "1h"})
        assert nothing.body == {"requeued": 0}

    stats = await api.get("/api/v1/stats", params={"series": "true", "window": "15m"})
    assert stats.status == 200, stats.text
    body = stats.body
    assert body["recent"]["delivered"]["attempts"] == 3
    assert body["recent"]["dead_letter"]["attempts"] == 1
    assert body["backlog"]["pending"] == 0 and body["dead_letters"]["waiting"] == 0
    health = {h["id"]: h for h in body["endpoints"]}
    assert health[good]["success_rate"] == 1.0 and health[good]["pending"] == 0
    assert health[bad]["success_rate"] == 0.5
    assert health[good]["breaker"] == {"state": "closed", "failures": 0}
    assert body["redis"] == {"configured": True, "reachable": True, "error": None}
    assert len(body["series"]) == 30
    assert sum(b["delivered"] for b in body["series"]) == 3
    assert sum(b["dead_letters"] for b in body["series"]) == 1
    assert body["series"][-1]["backlog"] == 0
    assert "url" not in health[good]  # the URL is only used to read the breaker


async def test_replay_of_a_retrying_delivery_makes_it_due_now(
    api: Api, database_url: str, receiver: Receiver
) -> None:
    answers = iter([503])

    def respond(item: Received) -> web.Response:
        return web.Response(status=next(answers, 200))

    receiver.respond = respond
    endpoint = await add_endpoint(api, receiver.url, "acme")
    accepted = await api.post(
        "/api/v1/events", json={"tenant": "acme", "stream_id": "s", "event_type": "t", "payload": 1}
    )
    event_id = accepted.body["id"]
    # A retry an hour away: only the replay can bring it forward.
    async with running_dispatcher(
        dispatcher_settings(retry_schedule_ms=(3_600_000,)), database_url
    ):
        await receiver.wait_for(1)

        async def retrying() -> bool:
            found = (await api.get(f"/api/v1/events/{event_id}")).body["deliveries"]
            return bool(found) and found[0]["status"] == "retrying"

        await wait_until(retrying, what="a retry scheduled")
        (item,) = (await api.get(f"/api/v1/events/{event_id}")).body["deliveries"]
        assert item["endpoint_id"] == endpoint and item["next_attempt_at"] is not None
        replayed = await api.post(f"/api/v1/deliveries/{item['delivery_id']}/replay")
        assert replayed.status == 202
        await receiver.wait_for(2)
        assert receiver.received[1].delivery_id == item["delivery_id"]
        assert receiver.received[1].attempt == 2  # the same retry, brought forward


async def test_deliveries_and_events_page_and_filter(api: Api, database_url: str) -> None:
    for i in range(23):
        reply = await api.post(
            "/api/v1/events",
            json={
                "tenant": "acme" if i % 2 else "bolt",
                "stream_id": f"s-{i % 3}",
                "event_type": "a.b" if i % 4 else "c.d",
                "payload": {"i": i},
            },
        )
        assert reply.status == 202
    events = await api.all_pages("/api/v1/events", limit=5)
    assert [e["payload"]["i"] for e in events] == list(range(22, -1, -1))  # newest first
    acme = await api.all_pages("/api/v1/events", limit=4, tenant="acme")
    assert len(acme) == 11 and {e["tenant"] for e in acme} == {"acme"}
    stream = await api.all_pages("/api/v1/events", limit=3, stream_id="s-1", event_type="c.d")
    assert {e["payload"]["i"] for e in stream} == {
        i for i in range(23) if i % 3 == 1 and i % 4 == 0
    }
    none = await api.get("/api/v1/events", params={"tenant": ""})
    assert none.body == {"data": [], "next_cursor": None}
    # Deliveries exist once routed: route them (nothing to send: no endpoint is enabled).

    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        for tenant in ("acme", "bolt"):
            created, _ = await endpoints.create(
                conn, url="http://127.0.0.1:9/hook", tenant=tenant, allowed_networks=LOOPBACK
            )
            await endpoints.disable(conn, created.id)
    more = await api.post(
        "/api/v1/events",
        json={"tenant": "acme", "stream_id": "late", "event_type": "x", "payload": 0},
    )
    async with running_dispatcher(dispatcher_settings(), database_url):

        async def routed() -> bool:
            found = await api.get(f"/api/v1/events/{more.body['id']}")
            return bool(found.body["deliveries"])

        await wait_until(routed, what="the late event routed")
    parked = await api.all_pages("/api/v1/deliveries", limit=1, status="parked")
    assert len(parked) == 1 and parked[0]["stream_id"] == "late"
    assert parked[0]["status"] == "parked" and parked[0]["attempt_count"] == 0
    for status in ("pending", "retrying", "delivered", "dead_letter"):
        assert (await api.get("/api/v1/deliveries", params={"status": status})).body["data"] == []
    bad = await api.get("/api/v1/deliveries", params={"status": "lost"})
    assert bad.status == 422 and bad.error_code == "validation_error"
    # Every filter sent empty (as docs/api.md writes the route, as a search form sends its
    # unfilled fields) is no filter; an empty tenant still means the default tenant.
    blank = {"endpoint_id": "", "status": "", "stream_id": "", "event_type": "", "cursor": ""}
    everything = await api.get("/api/v1/deliveries", params=blank)
    assert everything.status == 200 and len(everything.body["data"]) == 1
    assert (await api.get("/api/v1/deliveries", params={**blank, "tenant": ""})).body["data"] == []
    all_events = await api.get(
        "/api/v1/events", params={"stream_id": "", "event_type": "", "cursor": ""}
    )
    assert len(all_events.body["data"]) == 24


async def test_an_events_trace_context_over_http_reaches_its_consumer(
    api: Api, database_url: str, receiver: Receiver
) -> None:
    """A producer that enqueues over HTTP joins its trace as enqueue() does: the request's
    traceparent and tracestate are kept with the event, and the consumer's request carries
    them (no tracer here: the stored context is passed on). An invalid traceparent is
    dropped, with its tracestate."""
    await add_endpoint(api, receiver.url, "acme")
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    sent = {}
    for name, headers in {
        "traced": [("traceparent", parent), ("tracestate", "vendor=abc")],
        "garbled": [("traceparent", "00-not-a-trace-01"), ("tracestate", "vendor=abc")],
        # Repeated tracestate headers are one list (W3C): combined in their order.
        "split": [("traceparent", parent), ("tracestate", "a=1"), ("tracestate", "b=2")],
    }.items():
        reply = await api.post(
            "/api/v1/events",
            token="acme",
            json={"stream_id": name, "event_type": "invoice.paid", "payload": {}},
            headers=headers,
        )
        assert reply.status == 202, reply.text
        sent[name] = reply.body["id"]
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        cur = await conn.execute(
            "SELECT stream_id, traceparent, tracestate FROM webhook_outbox WHERE id = ANY(%s)",
            (list(sent.values()),),
        )
        stored = {r[0]: r[1:] for r in await cur.fetchall()}
    assert stored == {
        "traced": (parent, "vendor=abc"),
        "garbled": (None, None),
        "split": (parent, "a=1,b=2"),
    }
    async with running_dispatcher(dispatcher_settings(), database_url):
        await receiver.wait_for(3)
    assert len(receiver.received) == 3
    traced = [r for r in receiver.received if r.headers.get("traceparent") == parent]
    assert sorted(r.headers["tracestate"] for r in traced) == ["a=1,b=2", "vendor=abc"]
    assert sum("traceparent" in r.headers for r in receiver.received) == 2
    # The API names each event's stored context and the trace its deliveries' attempts are
    # in: the producer's, or (none stored) the delivery's own, as the dispatcher makes it.
    for name, event_id in sent.items():
        event = (await api.get(f"/api/v1/events/{event_id}", token="acme")).body
        assert event["traceparent"] == (None if name == "garbled" else parent)
        (listed,) = event["deliveries"]
        delivery_id = listed["delivery_id"]
        detail = (await api.get(f"/api/v1/deliveries/{delivery_id}", token="acme")).body
        own = hashlib.blake2b(delivery_id.encode(), digest_size=16).hexdigest()
        assert detail["trace_id"] == (own if name == "garbled" else parent[3:35])


async def test_removing_an_endpoint_adds_no_attempt_and_a_410_shows_as_parked(
    api: Api, database_url: str, receiver: Receiver
) -> None:
    """A 410 disables the endpoint and parks its delivery; another delivery is parked
    without ever being sent; then the endpoint is removed. The API counts the requests
    sent, as the dead letters do, and says why the deliveries ended."""
    receiver.respond = lambda r: web.Response(status=410)
    endpoint = await add_endpoint(api, receiver.url, "acme")

    async def send(stream_id: str) -> int:
        body = {"stream_id": stream_id, "event_type": "t", "payload": {}}
        reply = await api.post("/api/v1/events", token="acme", json=body)
        assert reply.status == 202, reply.text
        return int(reply.body["id"])

    async def only_delivery(event_id: int) -> dict[str, Any]:
        found = (await api.get(f"/api/v1/events/{event_id}")).body["deliveries"]
        return dict(found[0]) if found else {}

    first = await send("sent")
    async with running_dispatcher(dispatcher_settings(), database_url):
        await receiver.wait_for(1)

        async def gone() -> bool:
            shown = (await api.get(f"/api/v1/endpoints/{endpoint}")).body
            return bool(shown["disabled_reason"] == "gone")

        await wait_until(gone, what="the endpoint disabled by its 410")
        second = await send("never-sent")

        async def both_parked() -> bool:
            found = [await only_delivery(e) for e in (first, second)]
            return all(d.get("status") == "parked" for d in found)

        await wait_until(both_parked, what="both deliveries parked")
    sent = (await only_delivery(first))["delivery_id"]
    never = (await only_delivery(second))["delivery_id"]
    parked = await delivery(api, sent)
    assert parked["attempt_count"] == 1 and parked["dead_letter_reason"] is None
    (attempt,) = parked["attempts"]
    assert attempt["status_code"] == 410 and attempt["outcome"] == "parked"

    assert (await api.call("DELETE", f"/api/v1/endpoints/{endpoint}")).status == 204
    shown = {d: await delivery(api, d) for d in (sent, never)}
    for found in shown.values():
        assert found["status"] == "dead_letter"
        assert found["dead_letter_reason"] == "endpoint_removed"
    assert [(a["status_code"], a["outcome"]) for a in shown[sent]["attempts"]] == [(410, "parked")]
    assert shown[sent]["attempt_count"] == 1
    assert shown[never]["attempts"] == [] and shown[never]["attempt_count"] == 0
    assert shown[never]["last_attempt_at"] is None
    listed = await api.all_pages("/api/v1/deliveries", endpoint_id=endpoint)
    counts = {d["delivery_id"]: d["attempt_count"] for d in listed}
    assert counts == {sent: 1, never: 0}
    assert {d["delivery_id"]: d["last_attempt_at"] for d in listed}[never] is None
    # What `dlq list` shows.
    dead = await deadletters.list_dead(database_url, tenant="acme")
    assert {d["delivery_id"]: d["attempts"] for d in dead} == counts
    # The statistics (the overview's failed attempts, its chart) count the one request.
    stats = (await api.get("/api/v1/stats", params={"series": "true", "window": "15m"})).body
    assert sum(outcome["attempts"] for outcome in stats["recent"].values()) == 1
    outcomes = ("delivered", "retry", "dead_letter")
    assert sum(b[o] for b in stats["series"] for o in outcomes) == 1
    assert sum(b["dead_letters"] for b in stats["series"]) == 2  # both are dead letters


async def test_an_events_delivery_id_names_a_delivery_or_is_null(
    api: Api, database_url: str, receiver: Receiver
) -> None:
    """The event row's id is a delivery only for the built-in default endpoint: a named
    tenant's event (or the default tenant's with no WEBHOOK_URL) answers null, not an id
    that is 404 for ever."""
    await add_endpoint(api, receiver.url, "acme")
    body = {"stream_id": "s", "event_type": "t", "payload": {}}
    tenant = await api.post("/api/v1/events", token="acme", json=body)
    assert tenant.status == 202 and tenant.body["delivery_id"] is None
    assert tenant.body["id"] > 0
    unrouted = await api.post("/api/v1/events", json=body)
    assert unrouted.status == 202 and unrouted.body["delivery_id"] is None
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await endpoints.sync_builtin(conn, "default", receiver.url)
    builtin = await api.post("/api/v1/events", json=body)
    assert builtin.status == 202 and builtin.body["delivery_id"] is not None
    nowhere = await api.post("/api/v1/events", token="bolt", json=body)  # bolt has none
    # Not routed yet: said as such (an empty list alone reads as "no endpoint").
    waiting = (await api.get(f"/api/v1/events/{tenant.body['id']}")).body
    assert (waiting["routing"], waiting["deliveries"]) == ("pending", [])
    settings = dispatcher_settings(webhook_url=receiver.url, secret=b"s" * 32)
    async with running_dispatcher(settings, database_url):
        await receiver.wait_for(2)

        async def routed() -> bool:
            found = await api.get(f"/api/v1/events/{nowhere.body['id']}")
            return bool(found.body["routing"] != "pending")

        await wait_until(routed, what="bolt's event routed")
    events = {
        name: (await api.get(f"/api/v1/events/{reply.body['id']}")).body
        for name, reply in (("tenant", tenant), ("nowhere", nowhere), ("builtin", builtin))
    }
    assert {name: (e["routing"], len(e["deliveries"])) for name, e in events.items()} == {
        "tenant": ("routed", 1),
        "nowhere": ("unrouted", 0),  # no endpoint of bolt's subscribed: nothing sent
        "builtin": ("routed", 1),
    }
    async with running_dispatcher(settings, database_url):

        async def delivered() -> bool:
            found = await api.get(f"/api/v1/deliveries/{builtin.body['delivery_id']}")
            return found.status == 200 and found.body["status"] == "delivered"

        await wait_until(delivered, what="the default endpoint's delivery delivered")
    found = await delivery(api, builtin.body["delivery_id"])
    assert found["endpoint_id"] == "default" and found["event_id"] == builtin.body["id"]
    # Its id in capitals is the same delivery (a UUID is not case-sensitive).
    upper = builtin.body["delivery_id"].upper()
    assert (await delivery(api, upper))["delivery_id"] == builtin.body["delivery_id"]
    replayed = await api.post(f"/api/v1/deliveries/{upper}/replay")
    assert replayed.status == 202 and replayed.body["delivery_id"] == builtin.body["delivery_id"]


async def test_the_id_enqueue_returns_finds_its_event(api: Api, database_url: str) -> None:
    """A producer logs what ``enqueue`` returned (the event row's id for a named tenant):
    ``GET /api/v1/events/{id}`` takes it as it takes the event's number, in the same scope."""
    from fluxora_webhooks import enqueue

    with psycopg.connect(database_url) as conn, conn.transaction():
        returned = enqueue(
            conn, stream_id="s-9", event_type="invoice.paid", payload={"n": 9}, tenant="acme"
        )
    found = await api.get(f"/api/v1/events/{returned}", token="acme")
    assert found.status == 200, found.text
    assert found.body["stream_id"] == "s-9" and found.body["payload"] == {"n": 9}
    by_number = await api.get(f"/api/v1/events/{found.body['id']}", token="acme")
    assert by_number.body == found.body
    assert (await api.get(f"/api/v1/events/{returned}")).status == 200  # an admin
    as_urn = await api.get(f"/api/v1/events/urn:uuid:{returned}", token="acme")
    assert as_urn.status == 200 and as_urn.body["id"] == found.body["id"], as_urn.text
    for token, path in (
        ("bolt", f"/api/v1/events/{returned}"),  # another tenant: not found, not forbidden
        ("acme", "/api/v1/events/00000000-0000-4000-8000-000000000000"),
        ("acme", "/api/v1/events/not-an-id"),
    ):
        missing = await api.get(path, token=token)
        assert missing.status == 404 and missing.error_code == "not_found", missing.text


async def test_an_open_breaker_whose_time_is_up_shows_half_open(
    api: Api, redis_client: Any, prefix: str
) -> None:
    """A breaker opened by an earlier run and never probed since (no dispatcher sends to
    it, or the breaker is off now) showed 'open' for the day its key lives; once its time
    is up, its next request is the probe: half-open."""
    from fluxora_webhooks.redis_gate import breaker_key

    urls = {"up": "https://up.example.com/hook", "still": "https://still.example.com/hook"}
    ids = {name: await add_endpoint(api, url, "acme") for name, url in urls.items()}
    now_ms = int(time.time() * 1000)
    for name, reset_at in (("up", now_ms - 360_000), ("still", now_ms + 60_000)):
        await redis_client.hset(
            breaker_key(urls[name], prefix),
            mapping={"state": "open", "failures": 5, "reset_at": reset_at},
        )
    health = {h["id"]: h for h in (await api.get("/api/v1/stats")).body["endpoints"]}
    assert health[ids["up"]]["breaker"] == {"state": "half-open", "failures": 5}
    assert health[ids["still"]]["breaker"] == {"state": "open", "failures": 5}


async def test_an_ordered_streams_later_event_says_it_waits_for_the_earlier_one(
    api: Api, database_url: str, receiver: Receiver
) -> None:
    """Behind its stream's first event, which the consumer refuses for now (503), the
    second waits with no attempt used: its wait_reason (and the dashboard's 'why it
    waits') says so; it showed only 'pending', 'next attempt -'."""
    receiver.respond = lambda r: web.Response(status=503)
    endpoint = await add_endpoint(api, receiver.url, "acme", ordered=True)
    sent = []
    for n in (1, 2):
        body = {"stream_id": "order-7", "event_type": "t", "payload": {"n": n}}
        reply = await api.post("/api/v1/events", token="acme", json=body)
        assert reply.status == 202, reply.text
        sent.append(reply.body["id"])

    async def routed() -> bool:
        found = [(await api.get(f"/api/v1/events/{e}")).body["deliveries"] for e in sent]
        return all(found)

    async with running_dispatcher(dispatcher_settings(), database_url):
        await receiver.wait_for(1)
        await wait_until(routed, what="both events routed")
    first, second = [
        (await api.get(f"/api/v1/events/{e}")).body["deliveries"][0]["delivery_id"] for e in sent
    ]
    assert (await delivery(api, first))["wait_reason"] is None  # retrying: its attempt says
    waiting = await delivery(api, second)
    assert waiting["status"] == "pending" and waiting["attempt_count"] == 0
    assert waiting["wait_reason"] == deliveries.STREAM_WAIT
    assert endpoint == waiting["endpoint_id"]


async def test_a_payload_stored_deeper_than_the_api_serializes_is_left_out_not_a_500(
    api: Api, database_url: str
) -> None:
    """A SQL producer is not checked as enqueue is: one event nested 300 levels deep made
    every list it was on answer 500 (the newest events, its tenant's). It is listed, its
    payload null and why; one of 250 levels is shown whole."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        cur = await conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload, tenant)"
            " SELECT 's-' || d, 'deep', (repeat('[', d) || '1' || repeat(']', d))::jsonb, 'acme'"
            " FROM unnest(ARRAY[250, 300, 2000]) d RETURNING id"
        )
        shallow, deep, deeper = [r[0] for r in await cur.fetchall()]
    for token in ("admin", "acme"):
        listed = await api.get("/api/v1/events", token=token)
        assert listed.status == 200, listed.text
        by_id = {e["id"]: e for e in listed.body["data"]}
        for too_deep in (deep, deeper):  # 2,000: deeper than Python's JSON reader goes
            assert by_id[too_deep]["payload"] is None
            assert by_id[too_deep]["payload_omitted"] == deliveries.PAYLOAD_OMITTED
        assert by_id[shallow]["payload_omitted"] is None
        assert json.dumps(by_id[shallow]["payload"]).count("[") == 250
    for too_deep in (deep, deeper):
        one = await api.get(f"/api/v1/events/{too_deep}")
        assert one.status == 200 and one.body["payload_omitted"] == deliveries.PAYLOAD_OMITTED
