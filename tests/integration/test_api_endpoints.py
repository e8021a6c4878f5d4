"""The management API's endpoints resource, auth and error shape (SPEC 15), against the
real database: every route and status code, 401 for no or a bad token, 403 for a
read-only one, the OpenAPI document validated, and one error shape everywhere."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from openapi_spec_validator import validate

from fluxora_webhooks import endpoints
from tests.support.api import Api, serving
from tests.support.receiver import Receiver

pytestmark = pytest.mark.integration


async def test_endpoint_lifecycle_and_status_codes(api: Api, receiver: Receiver) -> None:
    created = await api.post(
        "/api/v1/endpoints",
        json={
            "url": receiver.url,
            "tenant": "acme",
            "event_types": ["invoice.*"],
            "description": "billing",
            "headers": {"X-Team": "billing"},
            "rate_limit": 5,
        },
    )
    assert created.status == 201, created.text
    endpoint = created.body
    assert endpoint["id"].startswith("ep_") and endpoint["secret"].startswith("whsec_")
    for key in ("tenant", "url", "event_types", "description", "headers", "rate_limit"):
        assert key in endpoint
    assert endpoint["tenant"] == "acme" and endpoint["state"] == "enabled"
    path = f"/api/v1/endpoints/{endpoint['id']}"

    shown = await api.get(path)
    assert shown.status == 200 and "secret" not in shown.body
    assert shown.body["event_types"] == ["invoice.*"]
    listed = await api.get("/api/v1/endpoints")
    assert [e["id"] for e in listed.body["data"]] == [endpoint["id"]]
    assert endpoint["secret"] not in listed.text and endpoint["secret"] not in shown.text

    patched = await api.call("PATCH", path, json={"description": "new", "rate_limit": None})
    assert patched.status == 200 and patched.body["description"] == "new"
    assert patched.body["rate_limit"] is None and patched.body["event_types"] == ["invoice.*"]

    disabled = await api.post(f"{path}/disable")
    assert disabled.status == 200 and disabled.body["state"] == "disabled"
    assert disabled.body["disabled_reason"] == "manual"
    enabled = await api.post(f"{path}/enable")
    assert enabled.status == 200 and enabled.body["state"] == "enabled"

    assert shown.body["previous_secret_until"] is None
    rotated = await api.post(f"{path}/rotate-secret")
    assert rotated.status == 200 and set(rotated.body) == {"id", "secret"}
    assert rotated.body["secret"] != endpoint["secret"]
    # Until when the old secret signs: the consumers' deadline (it was shown nowhere).
    until = datetime.fromisoformat((await api.get(path)).body["previous_secret_until"])
    assert timedelta(hours=23) < until - datetime.now(UTC) <= timedelta(hours=24)
    given = await api.post(f"{path}/rotate-secret", json={"secret": "x" * 32, "keep_previous": "0"})
    assert given.status == 200 and given.body["secret"] == "x" * 32
    assert (await api.get(path)).body["previous_secret_until"] is None

    recovered = await api.post(f"{path}/recover", json={"since": "2h"})
    assert recovered.status == 200 and recovered.body == {"requeued": 0}

    removed = await api.call("DELETE", path)
    assert removed.status == 204 and removed.text == ""
    for method in ("GET", "PATCH", "DELETE"):
        gone = await api.call(method, path, json={} if method == "PATCH" else None)
        assert gone.status == 404 and gone.error_code == "not_found"
    for action in ("disable", "enable", "rotate-secret"):
        gone = await api.post(f"{path}/{action}")
        assert gone.status == 404 and gone.error_code == "not_found"
    gone = await api.post(f"{path}/recover", json={"since": "1h"})
    assert gone.status == 404 and gone.error_code == "not_found"


async def test_validation_and_conflicts_answer_422_400_and_409(
    api: Api, receiver: Receiver
) -> None:
    bad = {
        "no url": {"tenant": "acme"},
        "a refused url": {"url": "http://10.0.0.1/hook"},
        "a reserved header": {"url": receiver.url, "headers": {"Webhook-Id": "x"}},
        "an unknown field": {"url": receiver.url, "colour": "red"},
        "a wrong type": {"url": receiver.url, "event_types": "invoice.*"},
        "a bad tenant": {"url": receiver.url, "tenant": "no spaces allowed"},
        "a short secret": {"url": receiver.url, "secret": "short"},
        "a secret with a no-break space": {"url": receiver.url, "secret": "a" * 20 + "\u00a0bcde"},
        "a url past 8000 characters": {"url": receiver.url + "?" + "q" * 8000},
        # Types as the document gives them, not coerced.
        "a number as text": {"url": receiver.url, "rate_limit": "10"},
        "a boolean as a number": {"url": receiver.url, "ordered": 1},
        "a boolean as text": {"url": receiver.url, "ordered": "yes"},
        "a number as a boolean": {"url": receiver.url, "rate_limit": True},
    }
    for what, body in bad.items():
        reply = await api.post("/api/v1/endpoints", json=body)
        assert reply.status == 422, what
        assert reply.error_code == "validation_error", what
    made = await api.post("/api/v1/endpoints", json={"url": receiver.url, "rate_limit": 5})
    path = f"/api/v1/endpoints/{made.body['id']}"
    for field in ("url", "description", "event_types", "headers", "ordered"):
        reply = await api.call("PATCH", path, json={field: None})
        assert reply.status == 422 and field in reply.body["error"]["message"], reply.text
    cleared = await api.call("PATCH", path, json={"rate_limit": None})
    assert cleared.status == 200 and cleared.body["rate_limit"] is None
    assert cleared.body["url"] == receiver.url  # nothing else changed
    broken = await api.post("/api/v1/endpoints", data="{not json")
    assert broken.status == 400 and broken.error_code == "bad_request"
    cursor = await api.get("/api/v1/endpoints", params={"cursor": "bm9wZQ"})
    assert cursor.status == 400 and cursor.error_code == "invalid_cursor"
    limit = await api.get("/api/v1/endpoints", params={"limit": "1001"})
    assert limit.status == 422 and limit.error_code == "validation_error"
    window = await api.post("/api/v1/endpoints/default/recover", json={"since": "yesterday-ish"})
    assert window.status == 404  # no default endpoint here: found first, parsed after
    # The built-in endpoint is configured from the environment: 409 for changes.
    async with await psycopg.AsyncConnection.connect(api.database_url, autocommit=True) as conn:
        await endpoints.sync_builtin(conn, "default", receiver.url)
    for method, action, body in (
        ("PATCH", "", {"description": "x"}),
        ("POST", "/rotate-secret", None),
        ("DELETE", "", None),
    ):
        reply = await api.call(method, f"/api/v1/endpoints/default{action}", json=body)
        assert reply.status == 409 and reply.error_code == "conflict", action
    window = await api.post("/api/v1/endpoints/default/recover", json={"since": "nonsense"})
    assert window.status == 422 and window.error_code == "validation_error"


# Every route of SPEC 15, with a body that passes validation where one is needed.
EP = "/api/v1/endpoints/ep_x"
DL = "/api/v1/deliveries/00000000-0000-0000-0000-000000000000"
READS = [
    "/api/v1/endpoints",
    EP,
    "/api/v1/events",
    "/api/v1/events/1",
    "/api/v1/deliveries",
    DL,
    "/api/v1/stats",
    "/api/v1/openapi.json",
]
WRITES: list[tuple[str, str, object]] = [
    ("POST", "/api/v1/endpoints", {"url": "https://example.com/hook"}),
    ("PATCH", EP, {"description": "x"}),
    ("DELETE", EP, None),
    ("POST", f"{EP}/disable", None),
    ("POST", f"{EP}/enable", None),
    ("POST", f"{EP}/rotate-secret", None),
    ("POST", f"{EP}/recover", {"since": "1h"}),
    ("POST", "/api/v1/events", {"stream_id": "s", "event_type": "t", "payload": {}}),
    ("POST", f"{DL}/replay", None),
]


async def test_no_bad_or_revoked_token_is_401_on_every_route(api: Api) -> None:
    async with await psycopg.AsyncConnection.connect(api.database_url, autocommit=True) as conn:
        from fluxora_webhooks import tokens

        await tokens.revoke(conn, "bolt")
    routes = [("GET", p, None) for p in READS] + WRITES
    for method, path, body in routes:
        for token in (None, "fxa_not-a-token", "bolt", ""):
            reply = await api.call(method, path, token=token, json=body)
            assert reply.status == 401, (method, path, token)
            assert reply.error_code == "unauthorized"
            assert reply.headers["www-authenticate"].startswith("Bearer")
    basic = await api.get("/api/v1/endpoints", token=None, headers={"Authorization": "Basic eA=="})
    assert basic.status == 401 and basic.error_code == "unauthorized"


async def test_a_read_only_token_reads_and_gets_403_on_every_write(api: Api) -> None:
    for path in READS:
        reply = await api.get(path, token="reader")
        assert reply.status in (200, 404), path
    for method, path, body in WRITES:
        for token in ("reader", "acme_reader"):
            reply = await api.call(method, path, token=token, json=body)
            assert reply.status == 403, (method, path, token)
            assert reply.error_code == "read_only"


async def test_unknown_routes_methods_and_the_openapi_document(api: Api) -> None:
    for path in ("/api/v1/nothing", "/api/v2/endpoints", "/api/v1/endpoints/x/explode"):
        reply = await api.get(path)
        assert reply.status == 404 and reply.error_code == "not_found", path
    wrong = await api.call("PUT", "/api/v1/endpoints")
    assert wrong.status == 405 and wrong.error_code == "method_not_allowed"
    doc = await api.get("/api/v1/openapi.json")
    assert doc.status == 200
    validate(doc.body)
    paths = doc.body["paths"]
    for path, methods in {
        "/api/v1/endpoints": {"get", "post"},
        "/api/v1/endpoints/{endpoint_id}": {"get", "patch", "delete"},
        "/api/v1/endpoints/{endpoint_id}/disable": {"post"},
        "/api/v1/endpoints/{endpoint_id}/enable": {"post"},
        "/api/v1/endpoints/{endpoint_id}/rotate-secret": {"post"},
        "/api/v1/endpoints/{endpoint_id}/recover": {"post"},
        "/api/v1/events": {"get", "post"},
        "/api/v1/events/{event_id}": {"get"},
        "/api/v1/deliveries": {"get"},
        "/api/v1/deliveries/{delivery_id}": {"get"},
        "/api/v1/deliveries/{delivery_id}/replay": {"post"},
        "/api/v1/stats": {"get"},
    }.items():
        assert set(paths[path]) == methods, path
    assert not [p for p in paths if not p.startswith("/api/v1/")]  # no dashboard routes
    assert doc.body["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    # The answers the server gives are in the document.
    assert {"400", "401", "403", "405", "413", "415", "422", "500"} <= set(
        paths["/api/v1/events"]["post"]["responses"]
    )
    assert {"405", "415"} <= set(paths["/api/v1/endpoints"]["post"]["responses"])
    assert "405" in paths["/api/v1/stats"]["get"]["responses"]
    assert "409" in paths["/api/v1/endpoints/{endpoint_id}"]["patch"]["responses"]
    assert "409" in paths["/api/v1/endpoints/{endpoint_id}/rotate-secret"]["post"]["responses"]
    # Security headers on API answers too.
    assert "frame-ancestors 'none'" in doc.headers["content-security-policy"]
    assert doc.headers["x-frame-options"] == "DENY"


async def test_endpoint_lists_page_through_more_than_a_page(api: Api, receiver: Receiver) -> None:
    made = set()
    for i in range(7):
        reply = await api.post(
            "/api/v1/endpoints", json={"url": receiver.url, "tenant": "acme" if i % 2 else "bolt"}
        )
        made.add(reply.body["id"])
    paged = await api.all_pages("/api/v1/endpoints", limit=2)
    assert {e["id"] for e in paged} == made and len(paged) == 7
    acme = await api.all_pages("/api/v1/endpoints", limit=2, tenant="acme")
    assert len(acme) == 3 and {e["tenant"] for e in acme} == {"acme"}
    exact = await api.get("/api/v1/endpoints", params={"limit": 7})
    assert len(exact.body["data"]) == 7 and exact.body["next_cursor"] is None


async def test_a_tenant_token_creates_endpoints_up_to_its_cap_and_no_further(
    database_url: str, redis_url: str, prefix: str
) -> None:
    """One event to a hundred endpoints with the same URL is a hundred requests: a tenant
    token (self-serve) has a cap; an admin does not, and a removal makes room again."""
    async with serving(database_url, redis_url, prefix, max_endpoints_per_tenant=3) as api:
        hook = {"url": "http://127.0.0.1:9/hook"}
        made = []
        for _ in range(3):
            reply = await api.post("/api/v1/endpoints", token="acme", json=hook)
            assert reply.status == 201, reply.text
            made.append(reply.body["id"])
        refused = await api.post("/api/v1/endpoints", token="acme", json=hook)
        assert refused.status == 409 and refused.error_code == "endpoint_limit"
        assert "has 3 endpoints, the most it may have (3)" in refused.body["error"]["message"]
        assert "WEBHOOK_" not in refused.body["error"]["message"]
        # The admin (the backend team) is not capped, even for that tenant.
        by_admin = await api.post("/api/v1/endpoints", json={**hook, "tenant": "acme"})
        assert by_admin.status == 201, by_admin.text
        # Another tenant counts its own: eight creates at once give exactly three.
        replies = await asyncio.gather(
            *(api.post("/api/v1/endpoints", token="bolt", json=hook) for _ in range(8))
        )
        assert sorted(r.status for r in replies) == [201] * 3 + [409] * 5
        async with await psycopg.AsyncConnection.connect(database_url) as conn:
            counted = await (
                await conn.execute(
                    "SELECT tenant, count(*) FROM webhook_endpoints"
                    " WHERE tenant IN ('acme', 'bolt') GROUP BY tenant ORDER BY tenant"
                )
            ).fetchall()
        assert counted == [("acme", 4), ("bolt", 3)]
        removed = await api.call("DELETE", f"/api/v1/endpoints/{made[0]}", token="acme")
        assert removed.status == 204, removed.text
        # Still four (the admin's one counts): no room until one more goes.
        again = await api.post("/api/v1/endpoints", token="acme", json=hook)
        assert again.status == 409
        await api.call("DELETE", f"/api/v1/endpoints/{made[1]}", token="acme")
        assert (await api.post("/api/v1/endpoints", token="acme", json=hook)).status == 201


async def test_a_custom_headers_credential_is_sent_never_shown_and_kept_by_its_mask(
    api: Api, receiver: Receiver, database_url: str
) -> None:
    """A custom header whose name says it carries a credential (Authorization, an API key,
    a token) is stored and sent as given, and shown as ******** in every endpoint object,
    to every token; given back as shown (a read, a change, a write of the whole map), the
    mask keeps the stored value; one with no value stored is refused by name."""
    bearer = "Bearer s3cr3t-header-value"
    created = await api.post(
        "/api/v1/endpoints",
        json={
            "url": receiver.url,
            "tenant": "acme",
            "headers": {"Authorization": bearer, "X-Team": "billing", "X-Api-Key": ""},
        },
    )
    assert created.status == 201, created.text
    shown_headers = {"Authorization": "********", "X-Team": "billing", "X-Api-Key": ""}
    listing = "/api/v1/endpoints?tenant=acme"
    assert created.body["headers"] == shown_headers
    path = f"/api/v1/endpoints/{created.body['id']}"
    for token in ("admin", "reader", "acme", "acme_reader"):
        for reply in (await api.get(path, token=token), await api.get(listing, token=token)):
            assert reply.status == 200, reply.text
            assert "s3cr3t-header-value" not in reply.text and "********" in reply.text

    def stored() -> object:
        with psycopg.connect(database_url) as conn:
            row = conn.execute(
                "SELECT headers FROM webhook_endpoints WHERE id = %s", (created.body["id"],)
            ).fetchone()
            assert row is not None
            return row[0]

    changed = await api.call(
        "PATCH", path, json={"headers": {**shown_headers, "X-Team": "ops"}}, token="acme"
    )
    assert changed.status == 200, changed.text
    assert changed.body["headers"] == {**shown_headers, "X-Team": "ops"}
    assert stored() == {"Authorization": bearer, "X-Team": "ops", "X-Api-Key": ""}

    refused = await api.call(
        "PATCH", path, json={"headers": {"Authorization": "********", "X-Auth-Token": "********"}}
    )
    assert refused.status == 422 and "X-Auth-Token" in refused.body["error"]["message"]
    assert stored() == {"Authorization": bearer, "X-Team": "ops", "X-Api-Key": ""}
    made = await api.post(
        "/api/v1/endpoints", json={"url": receiver.url, "headers": {"Cookie": "********"}}
    )
    assert made.status == 422 and "Cookie" in made.body["error"]["message"]

    replaced = await api.call("PATCH", path, json={"headers": {"authorization": "Basic bmV3"}})
    assert replaced.status == 200 and replaced.body["headers"] == {"authorization": "********"}
    assert stored() == {"authorization": "Basic bmV3"}
