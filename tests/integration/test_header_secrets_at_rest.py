"""Credential headers at rest (docs/security.md, "Secrets at rest"): with
WEBHOOK_ENCRYPTION_KEY set, the value of an endpoint's custom header whose name says it is a
credential (Authorization, an API key) is stored encrypted, bound to the endpoint, as its
secret is; other headers stay plain. The consumer gets the plain value, an update that
gives the value back as ******** keeps it, `secrets encrypt|decrypt` cover such values,
and one no key opens holds the endpoint's deliveries (never dead-lettered)."""

from __future__ import annotations

import logging
from typing import Any

import psycopg
import pytest
from aiohttp import web

from fluxora_webhooks import endpoints
from fluxora_webhooks.endpoints import HIDDEN_HEADER_VALUE, Changes
from fluxora_webhooks.errors import ConfigError
from fluxora_webhooks.secretbox import new_key
from fluxora_webhooks.signing import verify
from tests.support.api import LOOPBACK
from tests.support.dispatch import (
    deferred,
    due_now,
    enqueue_many,
    keyring,
    make_settings,
    rows,
    running_dispatcher,
    scalar,
    wait_until,
)
from tests.support.receiver import Received, Receiver

pytestmark = pytest.mark.integration

TOKEN = "hdr-bearer-token-0123456789abcdef"
PLAIN_SQL_SECRET = "plain-secret-written-by-sql-0123456789"


async def stored_headers(database_url: str, endpoint_id: str) -> tuple[dict[str, Any], str]:
    """The row's headers as stored, and the whole row as text."""
    ((headers, whole),) = await rows(
        database_url,
        "SELECT headers, row_to_json(e)::text FROM webhook_endpoints e WHERE id = %s",
        (endpoint_id,),
    )
    return headers, whole


def echo_authorization(hit: Received) -> web.Response:
    """A consumer that echoes the Authorization it got in its answer."""
    return web.Response(status=200, text=f"you sent {hit.headers.get('authorization')}")


async def test_a_credential_header_is_stored_encrypted_and_sent_plain(
    database_url: str, receiver: Receiver
) -> None:
    keys = keyring(new_key())
    assert keys.current is not None
    receiver.respond = echo_authorization
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        endpoint, secret = await endpoints.create(
            conn,
            url=receiver.url,
            tenant="hdr",
            headers={"Authorization": f"Bearer {TOKEN}", "X-Team": "blue"},
            allowed_networks=LOOPBACK,
            keys=keys,
        )
    headers, whole = await stored_headers(database_url, endpoint.id)
    assert headers["Authorization"].startswith(f"fxenc:v1:{keys.current.id}:")
    assert headers["X-Team"] == "blue"
    assert TOKEN not in whole
    # Shown masked, as before: neither the plain nor the sealed value.
    shown = endpoint.as_json()["headers"]
    assert shown == {"Authorization": HIDDEN_HEADER_VALUE, "X-Team": "blue"}

    await enqueue_many(database_url, 1, tenant="hdr")
    settings = make_settings("", allowed_networks=LOOPBACK, encryption_keys=keys)
    async with running_dispatcher(settings, database_url):
        await receiver.wait_for(1)
        hit = receiver.received[0]
        assert hit.headers["authorization"] == f"Bearer {TOKEN}"
        assert hit.headers["x-team"] == "blue"
        verify(hit.body, hit.headers, secret, scheme="fluxora")
        # The answer echoing it is stored masked: the opened value is what is masked.
        await wait_until(
            lambda: _answered(database_url, endpoint.id, 1), what="the attempt recorded"
        )
        (body,) = await rows(
            database_url,
            "SELECT response_body FROM webhook_outbox WHERE endpoint_id = %s",
            (endpoint.id,),
        )
        assert body[0] and body[0].startswith("you sent") and TOKEN not in body[0]

        # Given back masked (as every endpoint object shows it), the value is kept as
        # stored; another header changes.
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            changed = await endpoints.update(
                conn,
                endpoint.id,
                Changes(headers={"Authorization": HIDDEN_HEADER_VALUE, "X-Team": "red"}),
                allowed_networks=LOOPBACK,
                keys=keys,
            )
        assert changed.as_json()["headers"] == {
            "Authorization": HIDDEN_HEADER_VALUE,
            "X-Team": "red",
        }
        after, _ = await stored_headers(database_url, endpoint.id)
        assert after == {"Authorization": headers["Authorization"], "X-Team": "red"}
        await enqueue_many(database_url, 1, tenant="hdr")
        await receiver.wait_for(2)
    last = receiver.received[1]
    assert last.headers["authorization"] == f"Bearer {TOKEN}"
    assert last.headers["x-team"] == "red"


async def _answered(database_url: str, endpoint_id: str, count: int) -> bool:
    done = await scalar(
        database_url,
        "SELECT count(*) FROM webhook_outbox WHERE endpoint_id = %s AND processed",
        (endpoint_id,),
    )
    return bool(done == count)


async def test_the_checks_count_the_plain_value_and_a_new_value_is_encrypted(
    database_url: str,
) -> None:
    keys = keyring(new_key())
    # A long credential: sealed, its stored text is longer than a header value may be.
    long_token = "t" * 4000
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        endpoint, _ = await endpoints.create(
            conn,
            url="https://consumer.example/hook",
            headers={"X-Api-Key": long_token, "X-Team": "blue"},
            keys=keys,
        )
        headers, _ = await stored_headers(database_url, endpoint.id)
        assert len(headers["X-Api-Key"]) > 4096
        # Kept through the mask: checked as the 4000 characters it sends, not its ciphertext.
        await endpoints.update(
            conn,
            endpoint.id,
            Changes(headers={"X-Api-Key": HIDDEN_HEADER_VALUE, "X-Team": "red"}),
            keys=keys,
        )
        kept, _ = await stored_headers(database_url, endpoint.id)
        assert kept == {"X-Api-Key": headers["X-Api-Key"], "X-Team": "red"}
        # Headers that would come to more than 8192 bytes as sent are still refused.
        with pytest.raises(ConfigError, match=r"come to \d+ bytes"):
            await endpoints.update(
                conn,
                endpoint.id,
                Changes(
                    headers={
                        "X-Api-Key": HIDDEN_HEADER_VALUE,
                        "X-Other": "o" * 4096,
                        "X-More": "m" * 200,
                    }
                ),
                keys=keys,
            )
        # A new value replaces it, sealed afresh.
        await endpoints.update(
            conn, endpoint.id, Changes(headers={"X-Api-Key": f"k-{TOKEN}"}), keys=keys
        )
        new, whole = await stored_headers(database_url, endpoint.id)
        assert new["X-Api-Key"].startswith("fxenc:v1:") and TOKEN not in whole
        # A value given in the encrypted form is refused by name, never stored as such.
        with pytest.raises(ConfigError, match="X-Auth-Token must not start with fxenc:"):
            await endpoints.update(
                conn,
                endpoint.id,
                Changes(headers={"X-Auth-Token": "fxenc:v1:0a1b2c3d:c2VhbGVk"}),
                keys=keys,
            )


async def test_encrypt_and_decrypt_cover_credential_header_values(
    database_url: str, receiver: Receiver
) -> None:
    keys = keyring(new_key())
    assert keys.current is not None
    plain_headers = {"Authorization": f"Bearer {TOKEN}", "X-Team": "blue"}
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO webhook_endpoints (id, tenant, url, secret, headers)"
            " VALUES ('ep_plainhdr', 'enc', %s, %s, %s)",
            (receiver.url, PLAIN_SQL_SECRET, psycopg.types.json.Jsonb(plain_headers)),
        )
        done = await endpoints.reseal_secrets(conn, keys)
        assert (done.changed, done.rekeyed, done.unchanged, done.unreadable) == (2, 0, 0, [])
        headers, whole = await stored_headers(database_url, "ep_plainhdr")
        assert headers["Authorization"].startswith(f"fxenc:v1:{keys.current.id}:")
        assert headers["X-Team"] == "blue" and TOKEN not in whole
        again = await endpoints.reseal_secrets(conn, keys)
        assert (again.changed, again.unchanged) == (0, 2)

    await enqueue_many(database_url, 1, tenant="enc")
    settings = make_settings("", allowed_networks=LOOPBACK, encryption_keys=keys)
    async with running_dispatcher(settings, database_url):
        await receiver.wait_for(1)
    assert receiver.received[0].headers["authorization"] == f"Bearer {TOKEN}"

    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        opened = await endpoints.reseal_secrets(conn, keys, plain=True)
    assert (opened.changed, opened.unchanged, opened.unreadable) == (2, 0, [])
    assert (await stored_headers(database_url, "ep_plainhdr"))[0] == plain_headers
    # A plain value kept through the mask stays as stored (`secrets encrypt` seals it).
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await endpoints.update(
            conn,
            "ep_plainhdr",
            Changes(headers={"Authorization": HIDDEN_HEADER_VALUE, "X-Team": "red"}),
            allowed_networks=LOOPBACK,
            keys=keys,
        )
    assert (await stored_headers(database_url, "ep_plainhdr"))[0] == {
        **plain_headers,
        "X-Team": "red",
    }


async def test_a_header_no_key_opens_holds_its_deliveries(
    database_url: str, receiver: Receiver, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="fluxora_webhooks")
    right = keyring(new_key())
    assert right.current is not None
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        locked, _ = await endpoints.create(
            conn,
            url=receiver.url,
            tenant="lock",
            headers={"Authorization": f"Bearer {TOKEN}"},
            allowed_networks=LOOPBACK,
            keys=right,
        )
        # Its signing secret in plain text: only the header needs the key.
        await conn.execute(
            "UPDATE webhook_endpoints SET secret = %s WHERE id = %s", (PLAIN_SQL_SECRET, locked.id)
        )
    await enqueue_many(database_url, 1, tenant="lock")
    wrong = make_settings("", allowed_networks=LOOPBACK, encryption_keys=keyring(new_key()))

    async def held() -> bool:
        return await deferred(database_url, locked.id) == 1

    async with running_dispatcher(wrong, database_url):
        await wait_until(held, what="the locked endpoint's delivery deferred")
    assert receiver.received == []
    assert await scalar(database_url, "SELECT count(*) FROM webhook_dead_letter") == 0
    said = [r.getMessage() for r in caplog.records if locked.id in r.getMessage()]
    assert said and all(right.current.id in t and "Authorization" in t for t in said), said
    assert not any(TOKEN in r.getMessage() for r in caplog.records)
    # With the key, the held delivery goes with the plain value, its attempt unused.
    await due_now(database_url, locked.id)
    async with running_dispatcher(
        make_settings("", allowed_networks=LOOPBACK, encryption_keys=right), database_url
    ):
        await receiver.wait_for(1)
    hit = receiver.received[0]
    assert hit.headers["authorization"] == f"Bearer {TOKEN}"
    verify(hit.body, hit.headers, PLAIN_SQL_SECRET, scheme="fluxora")
    assert hit.attempt == 1
