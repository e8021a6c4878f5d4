"""The management API against its own OpenAPI document (SPEC 15), as a team that generates
a client from it relies on it: every answer of the main flows (endpoints, events with an
Idempotency-Key, deliveries delivered and dead-lettered by a real dispatcher, paging,
replay, recovery, rotation, statistics) and of every error kind has a status the
document lists for its operation, a body of the schema it gives (times checked as
`date-time`), the headers it declares, and an error code its description names; and the
document is one a client generator can use whole (header parameters are strings, an
optional body is its object, not "object or null").

The answers are validated with openapi-schema-validator (the JSON Schema validator of
OpenAPI 3.1 that openapi-spec-validator is built on), against the document the running
API serves."""

from __future__ import annotations

import dataclasses
import re
import uuid
import warnings
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
import pytest_asyncio
import trustme
from openapi_schema_validator import OAS31Validator

from fluxora_webhooks import endpoints as registry
from tests.support.api import LOOPBACK, Api, Reply
from tests.support.dispatch import make_settings, running_dispatcher, wait_until
from tests.support.receiver import Receiver, answering

pytestmark = pytest.mark.integration

# Headers that mean something to a client, which the document must then declare for the
# status they come with (the security headers and the HTTP server's own are left out).
MEANINGFUL_HEADERS = (
    "www-authenticate",
    "allow",
    "retry-after",
    "idempotent-replayed",
    "ratelimit-limit",
    "ratelimit-remaining",
    "ratelimit-reset",
)
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest_asyncio.fixture
async def failing() -> AsyncIterator[Receiver]:
    """A consumer that refuses every delivery for good (422): dead letters at once."""
    async with answering(422, "no") as recv:
        yield recv


@dataclasses.dataclass
class Document:
    """The served document, and what it says of one answer."""

    doc: dict[str, Any]
    checked: list[str] = dataclasses.field(default_factory=list)

    def operation(self, method: str, path: str, status: int) -> tuple[str, dict[str, Any]]:
        """The path's operation for ``method``; for a 405 (a method the path does not
        take), the 405 its operations document."""
        bare = path.split("?", 1)[0]
        for template, methods in self.doc["paths"].items():
            pattern = re.sub(r"\\{[^}]+\\}", "[^/]+", re.escape(template))
            if not re.fullmatch(pattern, bare):
                continue
            if method.lower() in methods:
                return template, methods[method.lower()]
            if status == 405:
                return template, next(iter(methods.values()))
        raise AssertionError(f"{method} {bare}: no operation in the document")

    def check(self, method: str, path: str, reply: Reply) -> None:
        template, operation = self.operation(method, path, reply.status)
        where = f"{method} {template} -> {reply.status}"
        documented = operation["responses"].get(str(reply.status))
        assert documented is not None, f"{where}: status not in the document ({reply.text})"
        content = documented.get("content", {}).get("application/json")
        if content is None:
            assert reply.text == "", where
        else:
            assert reply.headers["content-type"].startswith("application/json"), where
            schema = {**content["schema"], "components": self.doc["components"]}
            validator = OAS31Validator(schema, format_checker=OAS31Validator.FORMAT_CHECKER)
            problems = [e.message for e in validator.iter_errors(reply.body)]
            assert not problems, f"{where}: {problems[:3]} in {reply.text[:300]}"
        declared = {k.lower(): v for k, v in documented.get("headers", {}).items()}
        for name in MEANINGFUL_HEADERS:
            if name in reply.headers:
                assert name in declared, f"{where}: header {name} not in the document"
        for name, header in declared.items():
            if header.get("required"):
                assert name in reply.headers, f"{where}: documented header {name} not sent"
            if name in reply.headers:
                value: Any = reply.headers[name]
                if header["schema"].get("type") == "integer":
                    value = int(value)
                OAS31Validator(header["schema"]).validate(value)
        if reply.status >= 400:
            code = reply.error_code
            assert f"`{code}`" in documented["description"], f"{where}: code {code} undocumented"
        self.checked.append(where)


async def call(
    api: Api, doc: Document, method: str, path: str, status: int, **kw: Any
) -> dict[str, Any]:
    """A request whose answer is checked against the document; its body."""
    reply = await api.call(method, path, **kw)
    assert reply.status == status, f"{method} {path}: {reply.status} {reply.text}"
    doc.check(method, path, reply)
    body: dict[str, Any] = reply.body
    return body


async def served_document(api: Api) -> Document:
    reply = await api.get("/api/v1/openapi.json")
    assert reply.status == 200, reply.text
    return Document(reply.body)


def _schemas_of(node: Any) -> list[dict[str, Any]]:
    """Every schema object under ``node`` (with nested anyOf branches)."""
    found: list[dict[str, Any]] = []
    if isinstance(node, dict):
        found.append(node)
        for value in node.values():
            found.extend(_schemas_of(value))
    elif isinstance(node, list):
        for value in node:
            found.extend(_schemas_of(value))
    return found


async def test_a_client_generator_can_use_every_operation(api: Api) -> None:
    doc = (await served_document(api)).doc
    for template, methods in doc["paths"].items():
        for method, operation in methods.items():
            where = f"{method.upper()} {template}"
            for parameter in operation.get("parameters", []):
                if parameter["in"] != "header":
                    continue
                # A header value is a string: an array here makes generators drop the whole
                # operation (openapi-python-client: "not allowed in header").
                kinds = {s.get("type") for s in _schemas_of(parameter["schema"])} - {None}
                assert kinds <= {"string", "null"}, (where, parameter["name"], kinds)
            body = operation.get("requestBody")
            if body is not None and not body.get("required"):
                # An optional body is left out, not sent as null: "object or null" makes a
                # generated client send its own "unset" marker.
                schema = body["content"]["application/json"]["schema"]
                assert set(schema) == {"$ref"}, (where, schema)
    enqueue = doc["paths"]["/api/v1/events"]["post"]
    headers = {p["name"].lower() for p in enqueue["parameters"] if p["in"] == "header"}
    assert headers == {"idempotency-key", "traceparent", "tracestate"}
    replayed = enqueue["responses"]["202"]["headers"]["Idempotent-Replayed"]
    assert replayed["schema"] == {"type": "string", "enum": ["true"]}
    # Times are typed, so that a generated client reads datetimes, not strings.
    schemas = doc["components"]["schemas"]
    for name, field in [
        ("Endpoint", "created_at"),
        ("Endpoint", "disabled_at"),
        ("Endpoint", "failing_since"),
        ("Event", "created_at"),
        ("Delivery", "next_attempt_at"),
        ("Attempt", "at"),
        ("Bucket", "at"),
    ]:
        branches = schemas[name]["properties"][field]["anyOf"]
        assert {"type": "string", "format": "date-time"} in branches, (name, field)
    for status, header in [("401", "WWW-Authenticate"), ("405", "Allow"), ("503", "Retry-After")]:
        documented = doc["paths"]["/api/v1/endpoints"]["get"]["responses"][status]
        assert documented["headers"][header]["required"] is True, (status, header)
    listing = {p["name"]: p for p in doc["paths"]["/api/v1/deliveries"]["get"]["parameters"]}
    assert "next_cursor" in listing["cursor"]["description"]
    # Every answer the server can give is declared: a generated client that raises on an
    # undeclared status reads these as errors too.
    answers = doc["paths"]["/api/v1/events"]["post"]["responses"]
    assert "`request_timeout`" in answers["408"]["description"]
    assert "text/plain" in answers["431"]["content"]
    for name in ("Endpoint", "EndpointIn", "EndpointPatch"):
        url = schemas[name]["properties"]["url"]
        if name != "Endpoint":
            assert url.get("maxLength") == registry.MAX_URL_LENGTH, (name, url)
    reason = schemas["DeliveryDetail"]["properties"]["dead_letter_reason"]["description"]
    assert "attempts_exhausted" in reason and "max_attempts" not in reason


async def test_answers_of_the_main_flows_match_the_document(
    api: Api, database_url: str, receiver: Receiver, failing: Receiver
) -> None:
    doc = await served_document(api)
    endpoints = "/api/v1/endpoints"
    good = await call(
        api, doc, "POST", endpoints, 201, json={"url": receiver.url, "tenant": "acme"}
    )
    bad = await call(api, doc, "POST", endpoints, 201, token="acme", json={"url": failing.url})
    key = str(uuid.uuid4())
    event = {"stream_id": "s-1", "event_type": "invoice.paid", "payload": {"n": 1.5}}
    first = await call(
        api, doc, "POST", "/api/v1/events", 202, token="acme", json=event,
        headers={"Idempotency-Key": key, "traceparent": TRACEPARENT, "tracestate": "a=1"},
    )  # fmt: skip
    again = await api.post(
        "/api/v1/events", token="acme", json=event, headers={"Idempotency-Key": key}
    )
    assert again.status == 202 and again.headers["idempotent-replayed"] == "true"
    assert again.body == first
    doc.check("POST", "/api/v1/events", again)
    reused = {**event, "payload": None}
    await call(
        api, doc, "POST", "/api/v1/events", 422, token="acme", json=reused,
        headers={"Idempotency-Key": key},
    )  # fmt: skip
    for n in range(3):
        await call(
            api, doc, "POST", "/api/v1/events", 202,
            json={"tenant": "acme", "stream_id": f"s-{n}", "event_type": "x", "payload": [n]},
        )  # fmt: skip

    settings = dataclasses.replace(
        make_settings("", allowed_networks=LOOPBACK, secret=b""), retry_schedule_ms=(60_000,)
    )
    async with running_dispatcher(settings, database_url):

        async def settled() -> bool:
            listed = await api.get("/api/v1/deliveries", params={"limit": 1000})
            done = [d for d in listed.body["data"] if d["status"] in ("delivered", "dead_letter")]
            return len(done) == 8

        await wait_until(settled, what="every delivery delivered or dead-lettered")

        # Paging, with both tokens: every page matches, the pages together are the list.
        for token in ("admin", "acme"):
            seen: list[str] = []
            cursor = None
            while True:
                params = {"limit": 3, **({"cursor": cursor} if cursor else {})}
                page = await call(
                    api, doc, "GET", "/api/v1/deliveries", 200, token=token, params=params
                )
                seen += [d["delivery_id"] for d in page["data"]]
                cursor = page["next_cursor"]
                if cursor is None:
                    break
            assert len(seen) == len(set(seen)) == 8, token
        events = await call(api, doc, "GET", "/api/v1/events", 200, params={"limit": 2})
        assert events["next_cursor"] is not None
        shown = await call(api, doc, "GET", f"/api/v1/events/{first['id']}", 200, token="acme")
        assert shown["traceparent"] == TRACEPARENT
        dead = await call(
            api, doc, "GET", "/api/v1/deliveries", 200,
            params={"status": "dead_letter", "endpoint_id": bad["id"], "limit": 1},
        )  # fmt: skip
        dead_id = dead["data"][0]["delivery_id"]
        detail = await call(api, doc, "GET", f"/api/v1/deliveries/{dead_id}", 200)
        assert detail["dead_letter_reason"] and detail["attempts"][0]["status_code"] == 422
        await call(api, doc, "POST", f"/api/v1/deliveries/{dead_id}/replay", 202, token="acme")
        recovered = await call(
            api, doc, "POST", f"{endpoints}/{bad['id']}/recover", 200, json={"since": "1h"}
        )
        assert recovered["requeued"] >= 1

    path = f"{endpoints}/{good['id']}"
    await call(api, doc, "GET", path, 200, token="acme")
    await call(api, doc, "GET", endpoints, 200, params={"tenant": "acme", "limit": 1})
    await call(api, doc, "PATCH", path, 200, json={"rate_limit": None, "description": "d"})
    disabled = await call(api, doc, "POST", f"{path}/disable", 200, token="acme")
    assert disabled["disabled_at"] is not None
    await call(api, doc, "POST", f"{path}/enable", 200)
    await call(api, doc, "POST", f"{path}/rotate-secret", 200)  # no body at all
    await call(api, doc, "POST", f"{path}/rotate-secret", 200, json={"keep_previous": "1h"})
    issued = trustme.CA().issue_cert("acme-integration.example")
    pem = {
        "certificate": issued.cert_chain_pems[0].bytes().decode(),
        "private_key": issued.private_key_pem.bytes().decode(),
    }
    shown = await call(api, doc, "PUT", f"{path}/client-certificate", 200, json=pem)
    assert shown["client_certificate"]["fingerprint_sha256"]
    await call(api, doc, "PUT", f"{path}/client-certificate", 422, json={**pem, "private_key": "x"})
    await call(api, doc, "DELETE", f"{path}/client-certificate", 204)
    stats = await call(api, doc, "GET", "/api/v1/stats", 200, params={"series": "true"})
    assert stats["series"] and stats["endpoints"]
    await call(api, doc, "GET", "/api/v1/stats", 200, token="acme", params={"endpoints_limit": 1})

    # Every kind of error, in the document's shape, its code named there.
    await call(api, doc, "GET", endpoints, 401, token=None)
    await call(api, doc, "GET", endpoints, 401, token="fxa_not-a-token")
    await call(api, doc, "POST", f"{path}/disable", 403, token="reader")
    await call(api, doc, "GET", endpoints, 403, token="acme", params={"tenant": "bolt"})
    await call(api, doc, "GET", f"{endpoints}/ep_nothing", 404)
    await call(api, doc, "GET", path, 404, token="bolt")
    await call(api, doc, "GET", "/api/v1/events/12345678", 404)
    await call(api, doc, "PUT", endpoints, 405)
    await call(api, doc, "GET", endpoints, 400, params={"cursor": "not-a-cursor"})
    await call(api, doc, "POST", endpoints, 400, data="{")
    await call(api, doc, "POST", endpoints, 415, data="{}", headers={"Content-Type": "text/plain"})
    with warnings.catch_warnings():  # aiohttp's advice for large bodies, not a problem here
        warnings.simplefilter("ignore", ResourceWarning)
        await call(api, doc, "POST", "/api/v1/events", 413, data="x" * ((1 << 20) + 1))
    await call(api, doc, "POST", endpoints, 422, json={"url": "ftp://example.com/"})
    await call(api, doc, "GET", "/api/v1/deliveries", 422, params={"limit": 0})
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await registry.sync_builtin(conn, "default", receiver.url)
    await call(api, doc, "POST", "/api/v1/endpoints/default/rotate-secret", 409)
    await call(api, doc, "PUT", "/api/v1/endpoints/default/client-certificate", 409, json=pem)
    await call(api, doc, "DELETE", path, 204)
    assert len(doc.checked) > 40
