"""`Idempotency-Key` on POST /api/v1/events: a producer that retries its request (a timeout,
a 503 cut off by a failover) gets its first answer again, not a second event, also when the
requests arrive at once; the same key with another request is refused; keys are per tenant
and live 24 hours. Real API server, real PostgreSQL, a real dispatcher and receiver."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import pytest_asyncio
import trustme
from psycopg.types.json import Jsonb

from fluxora_webhooks import endpoints
from fluxora_webhooks.deliveries import EndpointRequest, create_endpoint_once, request_hash
from fluxora_webhooks.errors import IdempotencyKeyReused
from fluxora_webhooks.secretbox import keyring_from_env, new_key
from tests.support.api import LOOPBACK, Api, serving
from tests.support.dispatch import make_settings, running_dispatcher, scalar, wait_until
from tests.support.procs import command_env, run_json
from tests.support.receiver import Receiver

pytestmark = pytest.mark.integration

BODY: dict[str, Any] = {
    "stream_id": "order-1",
    "event_type": "order.paid",
    "payload": {"total": 12.5},
}


@pytest_asyncio.fixture
async def api(database_url: str, redis_url: str, prefix: str) -> AsyncIterator[Api]:
    async with serving(database_url, redis_url, prefix) as running:
        yield running


async def events(database_url: str) -> int:
    return await counted(database_url, "webhook_outbox WHERE event_id IS NULL")


async def waiting_for_locks(database_url: str, which: str) -> int:
    """How many sessions of the test's database wait for a lock, of those ``which`` (SQL
    over pg_stat_activity) picks."""
    waiting: int = await scalar(
        database_url,
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        f" AND wait_event_type = 'Lock' AND {which}",
    )
    return waiting


async def counted(database_url: str, rows: str) -> int:
    count: int = await scalar(database_url, f"SELECT count(*) FROM {rows}")
    return count


async def test_a_retried_request_gets_its_first_answer_and_is_delivered_once(
    api: Api, database_url: str, receiver: Receiver
) -> None:
    await api.post("/api/v1/endpoints", json={"url": receiver.url, "tenant": "acme"})
    key = {"Idempotency-Key": "7f1c9a52-retry-me"}
    first = await api.post("/api/v1/events", token="acme", json=BODY, headers=key)
    assert first.status == 202, first.text
    assert "idempotent-replayed" not in first.headers
    again = await api.post("/api/v1/events", token="acme", json=BODY, headers=key)
    assert again.status == 202, again.text
    assert again.headers.get("idempotent-replayed") == "true"
    assert again.body == first.body
    assert await events(database_url) == 1

    settings = dataclasses.replace(
        make_settings("", allowed_networks=LOOPBACK, secret=b""), poll_interval_ms=100
    )
    async with running_dispatcher(settings, database_url):
        await receiver.wait_for(1)
        await asyncio.sleep(0.5)  # time for a second request, were there one
    assert len(receiver.received) == 1
    assert json.loads(receiver.received[0].body) == {"total": 12.5}
    # Once the dispatcher has done with it, the key still answers the same.
    late = await api.post("/api/v1/events", token="acme", json=BODY, headers=key)
    assert late.status == 202 and late.body == first.body
    assert await events(database_url) == 1


async def test_requests_with_one_key_at_once_make_one_event(api: Api, database_url: str) -> None:
    key = {"Idempotency-Key": "burst"}
    replies = await asyncio.gather(
        *(api.post("/api/v1/events", token="acme", json=BODY, headers=key) for _ in range(12))
    )
    assert {r.status for r in replies} == {202}, [r.text for r in replies if r.status != 202]
    assert len({r.body["id"] for r in replies}) == 1
    assert sum(r.headers.get("idempotent-replayed") == "true" for r in replies) == 11
    assert await events(database_url) == 1


@pytest.mark.parametrize("first_ends", ["commit", "rollback"])
async def test_requests_racing_a_transaction_that_holds_the_key(
    api: Api, database_url: str, first_ends: str
) -> None:
    """Requests that found no key, enqueued, and then wait for another transaction taking
    the same key: when it commits, each rolls its event back and answers with that one's;
    when it rolls back, one of them takes the key and the rest answer with its event."""
    held = {"id": 0, "tenant": "acme", **BODY, "created_at": None, "delivery_id": None}
    async with await psycopg.AsyncConnection.connect(database_url) as holder:
        await holder.execute(
            "INSERT INTO webhook_idempotency_keys (tenant, key, request_hash, response)"
            " VALUES ('acme', 'race', %s, %s)",
            (
                request_hash("acme", BODY["stream_id"], BODY["event_type"], BODY["payload"]),
                Jsonb(held),
            ),
        )
        sent = [
            asyncio.ensure_future(
                api.post(
                    "/api/v1/events", token="acme", json=BODY, headers={"Idempotency-Key": "race"}
                )
            )
            for _ in range(4)
        ]

        async def all_waiting() -> bool:
            return (
                await waiting_for_locks(database_url, "query LIKE '%webhook_idempotency_keys%'")
                == 4
            )

        await wait_until(all_waiting, what="four requests waiting for the held key")
        await (holder.commit() if first_ends == "commit" else holder.rollback())
        replies = await asyncio.gather(*sent)
    assert {r.status for r in replies} == {202}, [r.text for r in replies]
    assert len({r.body["id"] for r in replies}) == 1
    replayed = sum(r.headers.get("idempotent-replayed") == "true" for r in replies)
    if first_ends == "commit":
        # The kept answer, answered through the event's model (fields added since: null).
        assert replies[0].body == {**held, "payload_omitted": None} and replayed == 4
        assert await events(database_url) == 0
    else:
        assert replayed == 3
        assert await events(database_url) == 1


async def test_the_same_key_with_another_request_is_refused_and_enqueues_nothing(
    api: Api, database_url: str
) -> None:
    key = {"Idempotency-Key": "k-1"}
    assert (await api.post("/api/v1/events", token="acme", json=BODY, headers=key)).status == 202
    for change in (
        {"payload": {"total": 13}},
        {"event_type": "order.refunded"},
        {"stream_id": "order-2"},
    ):
        other = await api.post("/api/v1/events", token="acme", json={**BODY, **change}, headers=key)
        assert other.status == 422, other.text
        assert other.error_code == "idempotency_key_reused"
        assert "Idempotency-Key" in other.body["error"]["message"]
    assert await events(database_url) == 1


async def test_keys_are_per_tenant_and_an_admin_shares_the_tenants(
    api: Api, database_url: str
) -> None:
    key = {"Idempotency-Key": "shared-name"}
    acme = await api.post("/api/v1/events", token="acme", json=BODY, headers=key)
    bolt = await api.post("/api/v1/events", token="bolt", json=BODY, headers=key)
    assert acme.status == bolt.status == 202
    assert acme.body["id"] != bolt.body["id"]  # another tenant's key is not this one's
    # An admin acting for acme uses acme's keys: the same request is acme's first answer.
    admin = await api.post(
        "/api/v1/events", token="admin", json={**BODY, "tenant": "acme"}, headers=key
    )
    assert admin.status == 202 and admin.body == acme.body
    # For the default tenant (no tenant given) the key is free again.
    default = await api.post("/api/v1/events", token="admin", json=BODY, headers=key)
    assert default.status == 202 and default.body["id"] not in (acme.body["id"], bolt.body["id"])
    assert await events(database_url) == 3
    # A read-only token may not enqueue, key or not.
    reader = await api.post("/api/v1/events", token="acme_reader", json=BODY, headers=key)
    assert reader.status == 403


async def test_a_key_lives_a_day_and_expired_keys_are_cleared(api: Api, database_url: str) -> None:
    key = {"Idempotency-Key": "daily"}
    first = await api.post("/api/v1/events", token="acme", json=BODY, headers=key)
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        # The oldest of all: the statement that takes it again clears others, not it.
        await conn.execute(
            "UPDATE webhook_idempotency_keys SET created_at = now() - interval '3 days'"
        )
        # Expired keys of other requests, as a day of traffic leaves them.
        await conn.execute(
            "INSERT INTO webhook_idempotency_keys (tenant, key, request_hash, response,"
            " created_at) SELECT 'bolt', 'old-' || n, 'x', '{}', now() - interval '2 days'"
            " FROM generate_series(1, 15) n"
        )
    # After 24 hours the key is free: the request is new, even a different one.
    later = await api.post(
        "/api/v1/events", token="acme", json={**BODY, "payload": {"n": 2}}, headers=key
    )
    assert later.status == 202 and "idempotent-replayed" not in later.headers
    assert later.body["id"] != first.body["id"]
    # ... and names the new request from then on.
    again = await api.post(
        "/api/v1/events", token="acme", json={**BODY, "payload": {"n": 2}}, headers=key
    )
    assert again.body == later.body and again.headers.get("idempotent-replayed") == "true"
    # The new key's request cleared ten of the expired ones on the way.
    left = await scalar(
        database_url, "SELECT count(*) FROM webhook_idempotency_keys WHERE tenant = 'bolt'"
    )
    assert left == 5


async def test_the_first_answer_outlives_its_pruned_event(api: Api, database_url: str) -> None:
    key = {"Idempotency-Key": "kept"}
    first = await api.post("/api/v1/events", token="acme", json=BODY, headers=key)
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute("DELETE FROM webhook_outbox")
    again = await api.post("/api/v1/events", token="acme", json=BODY, headers=key)
    assert again.status == 202 and again.body == first.body
    assert await events(database_url) == 0


@pytest.mark.parametrize(
    "value, why",
    [("", "empty"), ("x" * 256, "too long"), ("has space", "a space"), ("tab\there", "a tab")],
)
async def test_a_bad_key_is_a_validation_error_naming_the_header(
    api: Api, database_url: str, value: str, why: str
) -> None:
    reply = await api.post(
        "/api/v1/events", token="acme", json=BODY, headers={"Idempotency-Key": value}
    )
    assert reply.status == 422, (why, reply.text)
    assert reply.error_code == "validation_error"
    assert "idempotency-key" in reply.body["error"]["message"].lower()
    assert await events(database_url) == 0


# -- POST /api/v1/endpoints ---------------------------------------------------------------


async def endpoint_count(database_url: str) -> int:
    return await counted(database_url, "webhook_endpoints WHERE tenant IS NOT NULL")


async def test_a_retried_endpoint_creation_gets_the_first_endpoint_and_its_secret(
    api: Api, database_url: str, receiver: Receiver
) -> None:
    """A client whose create timed out retries with its key: the endpoint it made, with its
    secret (the one chance to read it), not a second endpoint with a secret of its own."""
    body = {"url": receiver.url, "event_types": ["order.*"], "description": "billing"}
    key = {"Idempotency-Key": "create-billing-1"}
    first = await api.post("/api/v1/endpoints", token="acme", json=body, headers=key)
    assert first.status == 201, first.text
    assert "idempotent-replayed" not in first.headers
    again = await api.post("/api/v1/endpoints", token="acme", json=body, headers=key)
    assert again.status == 201, again.text
    assert again.headers.get("idempotent-replayed") == "true"
    assert again.body["id"] == first.body["id"]
    assert again.body["secret"] == first.body["secret"] and first.body["secret"]
    assert await endpoint_count(database_url) == 1
    # The same key's text for an event of the tenant is another key.
    sent = await api.post("/api/v1/events", token="acme", json=BODY, headers=key)
    assert sent.status == 202 and "idempotent-replayed" not in sent.headers
    # Another field is another request: refused, nothing made.
    other = await api.post(
        "/api/v1/endpoints", token="acme", json={**body, "description": "other"}, headers=key
    )
    assert other.status == 422 and other.error_code == "idempotency_key_reused", other.text
    assert "another request" in other.body["error"]["message"]
    assert "url, event types" in other.body["error"]["message"]
    assert await endpoint_count(database_url) == 1
    # Another tenant's same key is its own.
    bolt = await api.post("/api/v1/endpoints", token="bolt", json=body, headers=key)
    assert bolt.status == 201 and "idempotent-replayed" not in bolt.headers, bolt.text
    assert bolt.body["id"] != first.body["id"]
    assert await endpoint_count(database_url) == 2
    # No secret is kept with the key.
    kept = await scalar(
        database_url,
        "SELECT string_agg(response::text, ' ') FROM webhook_idempotency_keys",
    )
    assert first.body["secret"] not in kept and bolt.body["secret"] not in kept


async def test_a_replayed_creation_after_a_rotation_or_a_removal(
    api: Api, database_url: str, receiver: Receiver
) -> None:
    body = {"url": receiver.url}
    key = {"Idempotency-Key": "create-then-rotate"}
    first = await api.post("/api/v1/endpoints", token="acme", json=body, headers=key)
    assert first.status == 201, first.text
    endpoint_id = first.body["id"]
    rotated = await api.post(f"/api/v1/endpoints/{endpoint_id}/rotate-secret", token="acme")
    assert rotated.status == 200, rotated.text
    again = await api.post("/api/v1/endpoints", token="acme", json=body, headers=key)
    assert again.status == 201 and again.headers.get("idempotent-replayed") == "true"
    assert again.body["id"] == endpoint_id
    assert again.body["secret"] is None  # not the rotated one: it was shown at its rotation
    removed = await api.call("DELETE", f"/api/v1/endpoints/{endpoint_id}", token="acme")
    assert removed.status in (200, 204), removed.text
    gone = await api.post("/api/v1/endpoints", token="acme", json=body, headers=key)
    assert gone.status == 404, gone.text
    assert await endpoint_count(database_url) == 0  # not made again


async def test_creations_with_one_key_at_once_make_one_endpoint(
    api: Api, database_url: str, receiver: Receiver
) -> None:
    body = {"url": receiver.url}
    key = {"Idempotency-Key": "create-at-once"}
    answers = await asyncio.gather(
        *(api.post("/api/v1/endpoints", token="acme", json=body, headers=key) for _ in range(5))
    )
    assert [a.status for a in answers] == [201] * 5, [a.text for a in answers]
    assert len({a.body["id"] for a in answers}) == 1
    assert len({a.body["secret"] for a in answers}) == 1
    assert sum(a.headers.get("idempotent-replayed") == "true" for a in answers) == 4
    assert await endpoint_count(database_url) == 1


async def test_creations_with_one_key_at_once_a_place_below_the_tenants_cap(
    database_url: str, redis_url: str, prefix: str, receiver: Receiver
) -> None:
    """The tenant has room for one more endpoint: requests with one key at once all get the
    endpoint the first one made, none a 409 endpoint_limit (the cap counted by a second
    creation that waited for the first)."""
    async with serving(database_url, redis_url, prefix, max_endpoints_per_tenant=2) as api:
        made = await api.post("/api/v1/endpoints", token="acme", json={"url": receiver.url})
        assert made.status == 201, made.text
        body = {"url": receiver.url, "description": "the second"}
        key = {"Idempotency-Key": "create-at-the-cap"}
        # The tenant's creations held a moment (as another creation of it would): the
        # requests are all in before the first one creates.
        async with await psycopg.AsyncConnection.connect(database_url) as holder:
            await holder.execute(
                "SELECT pg_advisory_xact_lock(hashtextextended('acme', 8512097725384027151))"
            )
            sent = [
                asyncio.ensure_future(
                    api.post("/api/v1/endpoints", token="acme", json=body, headers=key)
                )
                for _ in range(6)
            ]

            async def pool_waiting() -> bool:  # the API's pool holds 4 connections
                return await waiting_for_locks(database_url, "wait_event = 'advisory'") == 4

            await wait_until(pool_waiting, what="four requests waiting to create")
            await holder.rollback()
            answers = await asyncio.gather(*sent)
    assert [a.status for a in answers] == [201] * 6, [a.text for a in answers]
    assert len({a.body["id"] for a in answers}) == 1
    assert sum(a.headers.get("idempotent-replayed") == "true" for a in answers) == 5
    assert await endpoint_count(database_url) == 2


async def test_a_tenants_token_and_an_admin_naming_the_tenant_send_one_creation(
    api: Api, database_url: str, receiver: Receiver
) -> None:
    """The key is bound to the tenant the request is for, not to how it was named: an admin
    retrying a tenant's creation for it (or the tenant retrying an admin's) gets that
    endpoint, not 422 idempotency_key_reused."""
    body = {"url": receiver.url}
    key = {"Idempotency-Key": "create-for-acme"}
    first = await api.post("/api/v1/endpoints", token="acme", json=body, headers=key)
    assert first.status == 201, first.text
    admin = await api.post(
        "/api/v1/endpoints", token="admin", json={**body, "tenant": "acme"}, headers=key
    )
    assert admin.status == 201, admin.text
    assert admin.headers.get("idempotent-replayed") == "true"
    assert admin.body["id"] == first.body["id"]
    # The default tenant, named or not, is one request too.
    unnamed = await api.post("/api/v1/endpoints", token="admin", json=body, headers=key)
    named = await api.post(
        "/api/v1/endpoints", token="admin", json={**body, "tenant": ""}, headers=key
    )
    assert unnamed.status == named.status == 201, (unnamed.text, named.text)
    assert named.headers.get("idempotent-replayed") == "true"
    assert named.body["id"] == unnamed.body["id"] != first.body["id"]
    assert await endpoint_count(database_url) == 2


async def test_a_sealed_secrets_key_keeps_no_digest_a_guess_could_be_checked_against(
    database_url: str, receiver: Receiver
) -> None:
    """With secrets sealed at rest, what the key keeps can check no guess of a weak secret
    or credential header without the sealing key: its answer keeps a digest of the sealed
    value, its request the credentials' part under an HMAC of that key. With the key, a
    retry with another secret or header value is still told apart."""
    keys = keyring_from_env({"WEBHOOK_ENCRYPTION_KEY": new_key()})
    weak = "whsec_" + base64.b64encode(b"password-password-passwd").decode()
    headers = {"Authorization": "Bearer hunter2"}
    fields: dict[str, Any] = {"url": receiver.url, "secret": weak, "headers": headers}

    async def create() -> tuple[endpoints.Endpoint, str]:
        return await endpoints.create(
            conn, url=receiver.url, tenant="acme", secret=weak, headers=headers,
            allowed_networks=LOOPBACK, keys=keys,
        )  # fmt: skip

    request = EndpointRequest("acme", fields, None)
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        answers = [
            await create_endpoint_once(
                conn, "acme", "weak-1", request, create, scope=None, keys=keys
            )
            for _ in range(2)
        ]
        for other in ({"secret": weak + "x"}, {"headers": {"Authorization": "Bearer hunter3"}}):
            with pytest.raises(IdempotencyKeyReused):
                await create_endpoint_once(
                    conn, "acme", "weak-1", EndpointRequest("acme", {**fields, **other}, None),
                    create, scope=None, keys=keys,
                )  # fmt: skip
    assert [(e.id, secret, before) for e, secret, before in answers] == [
        (answers[0][0].id, weak, False),
        (answers[0][0].id, weak, True),
    ]
    kept = await scalar(database_url, "SELECT response::text FROM webhook_idempotency_keys")
    assert weak not in kept and hashlib.sha256(weak.encode()).hexdigest() not in kept
    bound = await scalar(database_url, "SELECT request_hash FROM webhook_idempotency_keys")
    assert bound == request.digest(keys)
    # What anyone without the key can compute from the right guesses is not what is kept.
    assert request.digest(keyring_from_env({})) != bound
    assert request.digest(keyring_from_env({"WEBHOOK_ENCRYPTION_KEY": new_key()})) != bound
    assert bound.partition(".")[0] == request.digest(keyring_from_env({})).partition(".")[0]


async def test_one_creation_through_the_cli_and_the_api_shares_its_key(
    api: Api, database_url: str, tmp_path: Path
) -> None:
    """A provisioning script that ran `endpoints add --idempotency-key` and retries through
    the API (or the other way round) sends one request, a client certificate included (a
    file for the CLI, JSON fields for the API): it gets the endpoint made first, not 422
    for a request shaped differently by the other side."""
    env = command_env(DATABASE_URL=database_url)
    issued = trustme.CA().issue_cert("acme-dispatcher.example")
    certificate = issued.cert_chain_pems[0].bytes().decode()
    private_key = issued.private_key_pem.bytes().decode()
    (tmp_path / "client.pem").write_text(certificate + private_key)
    url = "https://hooks.acme.example/in"
    fields: dict[str, Any] = {
        "url": url,
        "event_types": ["order.*", "invoice.paid"],
        "description": "billing",
        "headers": {"X-Team": "payments"},
        "rate_limit": 5,
        "client_certificate": {"certificate": certificate, "private_key": private_key},
    }
    cli_add = (
        "endpoints", "add", "--tenant", "acme", "--url", url,
        "--events", "order.*,invoice.paid", "--description", "billing",
        "--header", "X-Team=payments", "--rate-limit", "5",
        "--client-cert", str(tmp_path / "client.pem"), "--json",
    )  # fmt: skip
    code, made = await run_json(*cli_add, "--idempotency-key", "provision-1", env=env)
    assert code == 0, made
    key = {"Idempotency-Key": "provision-1"}
    crlf = {  # the same PEM texts, as a client on another system writes them
        "certificate": certificate.replace("\n", "\r\n"),
        "private_key": private_key.replace("\n", "\r\n") + "\r\n",
    }
    again = await api.post(
        "/api/v1/endpoints", token="acme", json={**fields, "client_certificate": crlf}, headers=key
    )
    assert again.status == 201 and again.headers.get("idempotent-replayed") == "true", again.text
    assert again.body["id"] == made["id"] and again.body["secret"] == made["secret"]
    for changed in ({"ordered": True}, {"client_certificate": None}):
        other = {**fields, **changed}
        refused = await api.post("/api/v1/endpoints", token="acme", json=other, headers=key)
        assert refused.status == 422 and refused.error_code == "idempotency_key_reused", changed

    key = {"Idempotency-Key": "provision-2"}
    first = await api.post("/api/v1/endpoints", json={**fields, "tenant": "acme"}, headers=key)
    assert first.status == 201, first.text
    code, replayed = await run_json(*cli_add, "--idempotency-key", "provision-2", env=env)
    assert code == 0 and replayed["replayed"] is True, replayed
    assert replayed["id"] == first.body["id"] and replayed["secret"] == first.body["secret"]
    assert await endpoint_count(database_url) == 2
