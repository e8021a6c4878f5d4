"""Tenant scoping over the API (SPEC 15): a tenant's token sees its own endpoints, events
and deliveries only -- another tenant's object is 404 on every route and absent from every
list and filter; naming another tenant in a body or a filter is 403. And no secret or
token ever appears in a list, a page or a log line."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
import pytest_asyncio

from fluxora_webhooks import endpoints
from tests.support.api import LOOPBACK, Api, serving
from tests.support.dispatch import make_settings, rows, running_dispatcher, wait_until

pytestmark = pytest.mark.integration
PER_TENANT = 12


@dataclasses.dataclass
class World:
    api: Api
    endpoint: dict[str, str]  # tenant -> its endpoint id
    secret: dict[str, str]
    event: dict[str, int]  # tenant -> one of its event ids
    delivery: dict[str, str]  # tenant -> one of its delivery ids


@pytest_asyncio.fixture
async def world(
    database_url: str, redis_url: str, prefix: str, caplog: pytest.LogCaptureFixture
) -> AsyncIterator[World]:
    caplog.set_level(logging.DEBUG)
    async with serving(database_url, redis_url, prefix) as api:
        endpoint, secret = {}, {}
        for tenant in ("acme", "bolt", ""):
            reply = await api.post(
                "/api/v1/endpoints", json={"url": "http://127.0.0.1:9/hook", "tenant": tenant}
            )
            assert reply.status == 201
            endpoint[tenant], secret[tenant] = reply.body["id"], reply.body["secret"]
            # Parked: routed deliveries with nothing sent anywhere.
            assert (await api.post(f"/api/v1/endpoints/{endpoint[tenant]}/disable")).status == 200
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            await conn.execute(
                "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload)"
                " SELECT t, 'stream-' || t || '-' || (g %% 3), 'thing.happened',"
                " jsonb_build_object('g', g)"
                " FROM unnest(ARRAY['acme', 'bolt', '']) t, generate_series(1, %s) g",
                (PER_TENANT,),
            )
        settings = make_settings("", allowed_networks=LOOPBACK, secret=b"")
        async with running_dispatcher(settings, database_url):

            async def routed() -> bool:
                found = await rows(
                    database_url,
                    "SELECT count(*) FROM webhook_outbox WHERE endpoint_id IS NOT NULL"
                    " AND hold = 'parked'",
                )
                return int(found[0][0]) == 3 * PER_TENANT

            await wait_until(routed, what="every event routed and parked")
        event, delivery = {}, {}
        for tenant in ("acme", "bolt", ""):
            found = await api.get("/api/v1/deliveries", params={"tenant": tenant, "limit": 1})
            delivery[tenant] = found.body["data"][0]["delivery_id"]
            event[tenant] = found.body["data"][0]["event_id"]
        yield World(api, endpoint, secret, event, delivery)


async def test_another_tenants_objects_are_404_on_every_route(world: World) -> None:
    api = world.api
    for token, own in (("acme", "acme"), ("default", "")):
        others = [t for t in ("acme", "bolt", "") if t != own]
        for other in others:
            ep = f"/api/v1/endpoints/{world.endpoint[other]}"
            dl = f"/api/v1/deliveries/{world.delivery[other]}"
            calls: list[tuple[str, str, Any]] = [
                ("GET", ep, None),
                ("PATCH", ep, {"description": "mine now"}),
                ("DELETE", ep, None),
                ("POST", f"{ep}/disable", None),
                ("POST", f"{ep}/enable", None),
                ("POST", f"{ep}/rotate-secret", None),
                ("POST", f"{ep}/recover", {"since": "1h"}),
                ("GET", f"/api/v1/events/{world.event[other]}", None),
                ("GET", dl, None),
                ("POST", f"{dl}/replay", None),
            ]
            for method, path, body in calls:
                reply = await api.call(method, path, token=token, json=body)
                assert reply.status == 404, (token, method, path, reply.text)
                assert reply.error_code == "not_found"
        # Its own objects answer.
        assert (
            await api.get(f"/api/v1/endpoints/{world.endpoint[own]}", token=token)
        ).status == 200
        assert (await api.get(f"/api/v1/events/{world.event[own]}", token=token)).status == 200
        mine = await api.get(f"/api/v1/deliveries/{world.delivery[own]}", token=token)
        assert mine.status == 200 and mine.body["tenant"] == own
        replay = await api.post(f"/api/v1/deliveries/{world.delivery[own]}/replay", token=token)
        assert replay.status == 202 and replay.body["status"] == "parked"  # stays parked
    # Nothing of another tenant changed.
    for tenant in ("bolt",):
        shown = await api.get(f"/api/v1/endpoints/{world.endpoint[tenant]}")
        assert shown.body["state"] == "disabled" and shown.body["description"] == ""


async def test_lists_and_filters_hold_only_the_tokens_tenant(world: World) -> None:
    api = world.api
    for token, own in (("acme", "acme"), ("bolt", "bolt"), ("default", "")):
        for path in ("/api/v1/endpoints", "/api/v1/events", "/api/v1/deliveries"):
            found = await api.all_pages(path, token=token, limit=5)
            assert found and {x["tenant"] for x in found} == {own}, (token, path)
            if path != "/api/v1/endpoints":
                assert len(found) == PER_TENANT  # across three pages
            same = await api.all_pages(path, token=token, limit=50, tenant=own)
            assert same == found
            for other in {"acme", "bolt", ""} - {own}:
                reply = await api.get(path, token=token, params={"tenant": other})
                assert reply.status == 403 and reply.error_code == "tenant_forbidden"
        filtered = await api.all_pages(
            "/api/v1/deliveries",
            token=token,
            limit=4,
            endpoint_id=world.endpoint["bolt"],
            status="parked",
            event_type="thing.happened",
        )
        assert len(filtered) == (PER_TENANT if own == "bolt" else 0)
        stream = await api.all_pages(
            "/api/v1/events", token=token, limit=2, stream_id="stream-bolt-1"
        )
        assert len(stream) == (4 if own == "bolt" else 0)
        stats = await api.get("/api/v1/stats", token=token, params={"series": "true"})
        assert [h["id"] for h in stats.body["endpoints"]] == [world.endpoint[own]]
        assert stats.body["backlog"]["pending"] == PER_TENANT
        assert stats.body["backlog"]["parked"] == PER_TENANT
        assert stats.body["series"][-1]["backlog"] == PER_TENANT
        for other in {"acme", "bolt", ""} - {own}:
            refused = await api.get("/api/v1/stats", token=token, params={"tenant": other})
            assert refused.status == 403 and refused.error_code == "tenant_forbidden"
    admin = await api.all_pages("/api/v1/deliveries", limit=10)
    assert len(admin) == 3 * PER_TENANT
    default_only = await api.all_pages("/api/v1/deliveries", limit=10, tenant="")
    assert {d["tenant"] for d in default_only} == {""} and len(default_only) == PER_TENANT
    assert (await api.get("/api/v1/stats")).body["backlog"]["pending"] == 3 * PER_TENANT
    for tenant in ("acme", "bolt", ""):  # an admin's filter
        one = await api.get("/api/v1/stats", params={"tenant": tenant})
        assert one.body["backlog"]["pending"] == PER_TENANT, tenant
        assert [h["id"] for h in one.body["endpoints"]] == [world.endpoint[tenant]]


async def test_a_tenant_token_cannot_write_for_another_tenant(world: World) -> None:
    api = world.api
    for body_tenant in ("bolt", ""):
        made = await api.post(
            "/api/v1/endpoints",
            token="acme",
            json={"url": "http://127.0.0.1:9/x", "tenant": body_tenant},
        )
        assert made.status == 403 and made.error_code == "tenant_forbidden"
        sent = await api.post(
            "/api/v1/events",
            token="acme",
            json={"tenant": body_tenant, "stream_id": "s", "event_type": "t", "payload": {}},
        )
        assert sent.status == 403 and sent.error_code == "tenant_forbidden"
    own = await api.post("/api/v1/endpoints", token="acme", json={"url": "http://127.0.0.1:9/y"})
    assert own.status == 201 and own.body["tenant"] == "acme"
    event = await api.post(
        "/api/v1/events", token="acme", json={"stream_id": "s", "event_type": "t", "payload": 1}
    )
    assert event.status == 202 and event.body["tenant"] == "acme"
    # An admin's event names a tenant that could have endpoints and tokens, or none.
    for bad in ("<b>", "a b", "x" * 200):
        refused = await api.post(
            "/api/v1/events",
            json={"tenant": bad, "stream_id": "s", "event_type": "t", "payload": {}},
        )
        assert refused.status == 422 and refused.error_code == "validation_error", bad
        assert "tenant" in refused.body["error"]["message"]


async def test_no_secret_or_token_in_any_list_page_or_log(
    world: World, database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    api = world.api
    rotated = await api.post(f"/api/v1/endpoints/{world.endpoint['acme']}/rotate-secret")
    secrets = [*world.secret.values(), rotated.body["secret"], *api.tokens.values()]
    for change in ("disable", "disable", "enable", "enable"):  # each asked twice
        reply = await api.post(f"/api/v1/endpoints/{world.endpoint['acme']}/{change}")
        assert reply.status == 200, reply.text
    api.seen.clear()
    for token in ("admin", "acme"):
        for path in ("/api/v1/endpoints", "/api/v1/events", "/api/v1/deliveries", "/api/v1/stats"):
            assert (await api.get(path, token=token)).status == 200
        for tenant, endpoint_id in world.endpoint.items():
            await api.get(f"/api/v1/endpoints/{endpoint_id}", token=token)
            await api.get(f"/api/v1/deliveries/{world.delivery[tenant]}", token=token)
    await api.get("/api/v1/openapi.json")
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        listed = await endpoints.list_endpoints(conn)
    assert all("secret" not in e.as_json() for e in listed)
    seen = "\n".join(api.seen)
    # Every line the service logged while the world was built and the test ran, however an
    # earlier test in this process left the logging configuration.
    records = [*caplog.get_records("setup"), *caplog.get_records("call")]
    logged = "\n".join(f"{r.getMessage()} {r.exc_text or ''}" for r in records)
    # Audit lines: what changed in the registry, by which token (its name only).
    acme = world.endpoint["acme"]
    for line in (f"secret of endpoint {acme} rotated", f"endpoint {acme} disabled by token"):
        assert line in logged
    assert f"endpoint {acme} enabled by token" in logged and "created for tenant" in logged
    # The log says what changed: a second disable or enable changed nothing.
    assert logged.count(f"endpoint {acme} disabled by token") == 1, logged
    assert logged.count(f"endpoint {acme} enabled by token") == 1, logged
    for value in secrets:
        assert value not in seen
        assert value not in logged


async def test_a_tenant_is_not_told_why_redis_cannot_be_read(database_url: str) -> None:
    """Redis down: an admin's stats say what failed (host and port, no password); a
    tenant's say only that the breakers cannot be read, nothing of the deployment."""
    async with serving(database_url, "redis://:pw-of-redis-77@127.0.0.1:1/0") as api:
        made = await api.post(
            "/api/v1/endpoints", json={"url": "http://127.0.0.1:9/hook", "tenant": "acme"}
        )
        assert made.status == 201
        admin = (await api.get("/api/v1/stats")).body["redis"]
        tenant = (await api.get("/api/v1/stats", token="acme")).body["redis"]
    assert admin["reachable"] is False and "127.0.0.1:1" in admin["error"]
    assert tenant == {
        "configured": True,
        "reachable": False,
        "error": "the circuit breakers' states cannot be read now",
    }
    assert not any("pw-of-redis-77" in text for text in api.seen)


async def test_an_admin_reads_operator_events_and_a_tenant_never_does(database_url: str) -> None:
    """An operator event's delivery is in an admin's lists, and its event opens for the
    admin; no tenant's token sees it, by id or in a list."""
    async with serving(database_url) as api:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            await endpoints.sync_builtin(conn, "operator", "http://127.0.0.1:9/operator")
        made = await api.post(
            "/api/v1/endpoints", json={"url": "http://127.0.0.1:9/hook", "tenant": "acme"}
        )
        assert made.status == 201
        disabled = await api.post(f"/api/v1/endpoints/{made.body['id']}/disable", token="acme")
        assert disabled.status == 200
        (told,) = await api.all_pages("/api/v1/deliveries", endpoint_id="operator")
        assert told["event_type"] == "endpoint.disabled"
        event = await api.get(f"/api/v1/events/{told['event_id']}")
        assert event.status == 200, event.text
        assert event.body["tenant"] is None and event.body["event_type"] == "endpoint.disabled"
        assert event.body["payload"]["endpoint_id"] == made.body["id"]
        assert [d["delivery_id"] for d in event.body["deliveries"]] == [told["delivery_id"]]
        assert (await api.get(f"/api/v1/events/{told['event_id']}", token="reader")).status == 200
        for token in ("acme", "acme_reader", "bolt", "default"):
            hidden = await api.get(f"/api/v1/events/{told['event_id']}", token=token)
            assert hidden.status == 404 and hidden.error_code == "not_found", token
            events = await api.all_pages("/api/v1/events", token=token)
            assert told["event_id"] not in {e["id"] for e in events}
            deliveries = await api.all_pages("/api/v1/deliveries", token=token)
            assert told["delivery_id"] not in {d["delivery_id"] for d in deliveries}
