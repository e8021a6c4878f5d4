"""Endpoint secrets at rest (docs/security.md, "Secrets at rest"): with
WEBHOOK_ENCRYPTION_KEY set, no secret is stored in plain text, and deliveries still verify
with the plain secret at a real consumer; plain rows keep working beside encrypted ones; a
key rotation opens the previous key's values; a secret no key opens holds its deliveries
(never dead-lettered) and says which key it needs."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

import psycopg
import pytest

from fluxora_webhooks import endpoints
from fluxora_webhooks.batch import LOCKED_WAIT
from fluxora_webhooks.errors import ConflictError
from fluxora_webhooks.secretbox import NO_KEYS, new_key
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
from tests.support.receiver import Receiver

pytestmark = pytest.mark.integration

PLAIN_SQL_SECRET = "plain-secret-written-by-sql-0123456789"


async def stored(database_url: str, endpoint_id: str) -> tuple[str, str | None, str]:
    ((secret, previous, whole),) = await rows(
        database_url,
        "SELECT secret, secret_previous, row_to_json(e)::text FROM webhook_endpoints e"
        " WHERE id = %s",
        (endpoint_id,),
    )
    return secret, previous, whole


def verified_by(receiver: Receiver, secret: str) -> int:
    """How many requests the receiver got, each checked with the plain ``secret`` under
    both schemes (a failed check raises)."""
    for hit in receiver.received:
        verify(hit.body, hit.headers, secret, scheme="fluxora")
        verify(hit.body, hit.headers, secret, scheme="standard")
    return len(receiver.received)


async def test_an_endpoint_created_with_the_key_is_stored_encrypted_and_verifies(
    database_url: str, receiver: Receiver
) -> None:
    keys = keyring(new_key())
    assert keys.current is not None
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        endpoint, secret = await endpoints.create(
            conn, url=receiver.url, tenant="acme", allowed_networks=LOOPBACK, keys=keys
        )
    assert secret.startswith("whsec_")
    column, previous, whole = await stored(database_url, endpoint.id)
    assert column.startswith(f"fxenc:v1:{keys.current.id}:") and previous is None
    # Neither the secret nor its key (the base64 part) anywhere in the row.
    assert secret not in whole and secret.removeprefix("whsec_") not in whole
    await enqueue_many(database_url, 2, tenant="acme")
    settings = make_settings("", allowed_networks=LOOPBACK, encryption_keys=keys)
    async with running_dispatcher(settings, database_url):
        await receiver.wait_for(2)
        assert verified_by(receiver, secret) == 2
        # Rotated: the new secret is stored encrypted too, the old one moved as it was.
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            _, rotated = await endpoints.rotate_secret(conn, endpoint.id, keys=keys)
        new_column, moved, whole = await stored(database_url, endpoint.id)
        assert moved == column and new_column.startswith("fxenc:v1:")
        assert rotated not in whole and rotated.removeprefix("whsec_") not in whole
        await enqueue_many(database_url, 1, tenant="acme")
        await receiver.wait_for(3)
    last = receiver.received[2]
    verify(last.body, last.headers, rotated, scheme="fluxora")
    # Both signatures while the old secret keeps signing: each verifies on its own.
    verify(last.body, last.headers, rotated, scheme="standard")
    verify(last.body, last.headers, secret, scheme="standard")


async def test_plain_rows_keep_working_beside_encrypted_ones(
    database_url: str, receiver: Receiver
) -> None:
    keys = keyring(new_key())
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO webhook_endpoints (id, tenant, url, secret, headers)"
            """ VALUES ('ep_plain', 'mix', %s, %s, '{"X-Endpoint": "ep_plain"}')""",
            (receiver.url, PLAIN_SQL_SECRET),
        )
        sealed, secret = await endpoints.create(
            conn,
            url=receiver.url,
            tenant="mix",
            headers={"X-Endpoint": "sealed"},
            allowed_networks=LOOPBACK,
            keys=keys,
        )
    await enqueue_many(database_url, 2, tenant="mix")
    settings = make_settings("", allowed_networks=LOOPBACK, encryption_keys=keys)
    async with running_dispatcher(settings, database_url):
        await receiver.wait_for(4)
    by_endpoint = {"ep_plain": PLAIN_SQL_SECRET, "sealed": secret}
    for hit in receiver.received:
        plain = by_endpoint[hit.headers["x-endpoint"]]
        verify(hit.body, hit.headers, plain, scheme="fluxora")
        verify(hit.body, hit.headers, plain, scheme="standard")
    assert sorted(h.headers["x-endpoint"] for h in receiver.received) == [
        "ep_plain",
        "ep_plain",
        "sealed",
        "sealed",
    ]
    assert (await stored(database_url, "ep_plain"))[0] == PLAIN_SQL_SECRET
    assert (await stored(database_url, sealed.id))[0].startswith("fxenc:v1:")


async def test_a_key_rotation_opens_the_previous_keys_secrets_and_moves_them(
    database_url: str, receiver: Receiver
) -> None:
    old_key, new = new_key(), new_key()
    old = keyring(old_key)
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        endpoint, secret = await endpoints.create(
            conn, url=receiver.url, tenant="rot", allowed_networks=LOOPBACK, keys=old
        )
    both = keyring(new, previous=old_key)
    assert both.current is not None and old.current is not None
    await enqueue_many(database_url, 1, tenant="rot")
    settings = make_settings("", allowed_networks=LOOPBACK, encryption_keys=both)
    async with running_dispatcher(settings, database_url):
        await receiver.wait_for(1)
    assert verified_by(receiver, secret) == 1
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        done = await endpoints.reseal_secrets(conn, both)
        assert (done.changed, done.rekeyed, done.unreadable) == (1, 1, [])
        again = await endpoints.reseal_secrets(conn, both)
        assert (again.changed, again.unchanged) == (0, 1)
    column, _, _ = await stored(database_url, endpoint.id)
    assert column.startswith(f"fxenc:v1:{both.current.id}:")
    # The previous key dropped: the current one alone opens it.
    await enqueue_many(database_url, 1, tenant="rot")
    only_new = make_settings("", allowed_networks=LOOPBACK, encryption_keys=keyring(new))
    async with running_dispatcher(only_new, database_url):
        await receiver.wait_for(2)
    assert verified_by(receiver, secret) == 2


async def test_a_secret_no_key_opens_holds_its_deliveries_and_names_the_key(
    database_url: str, receiver: Receiver, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="fluxora_webhooks")
    right = keyring(new_key())
    assert right.current is not None
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        locked, secret = await endpoints.create(
            conn, url=receiver.url, tenant="lock", allowed_networks=LOOPBACK, keys=right
        )
        await conn.execute(
            "INSERT INTO webhook_endpoints (id, tenant, url, secret, headers)"
            """ VALUES ('ep_fine', 'lock', %s, %s, '{"X-Endpoint": "ep_fine"}')""",
            (receiver.url, PLAIN_SQL_SECRET),
        )
    await enqueue_many(database_url, 1, tenant="lock")
    wrong = make_settings("", allowed_networks=LOOPBACK, encryption_keys=keyring(new_key()))

    async def held() -> bool:
        return await deferred(database_url, locked.id) == 1

    async with running_dispatcher(wrong, database_url):
        await receiver.wait_for(1)  # the other endpoint of the tenant is sent to
        await wait_until(held, what="the locked endpoint's delivery deferred")
    assert [h.headers["x-endpoint"] for h in receiver.received] == ["ep_fine"]
    assert await scalar(database_url, "SELECT count(*) FROM webhook_dead_letter") == 0
    assert (
        await scalar(
            database_url,
            "SELECT count(*) FROM webhook_outbox"
            " WHERE endpoint_id = %s AND outcome = 'dead_letter'",
            (locked.id,),
        )
        == 0
    )
    said = [r.getMessage() for r in caplog.records if locked.id in r.getMessage()]
    assert said and all(right.current.id in text for text in said), said
    assert not any(secret in r.getMessage() for r in caplog.records)
    # Said where the delivery is read too (it showed 'pending' and nothing more), without
    # the key id (tenants read it).
    assert (
        await scalar(
            database_url,
            "SELECT error FROM webhook_outbox WHERE endpoint_id = %s AND NOT processed",
            (locked.id,),
        )
        == LOCKED_WAIT
    )
    # With the key, the held delivery goes (made due now: it waits its deferral otherwise).
    await due_now(database_url, locked.id)
    async with running_dispatcher(
        make_settings("", allowed_networks=LOOPBACK, encryption_keys=right), database_url
    ):
        await receiver.wait_for(2)
    hit = receiver.received[1]
    assert "x-endpoint" not in hit.headers
    verify(hit.body, hit.headers, secret, scheme="fluxora")
    assert hit.attempt == 1  # waiting consumed no attempt


async def test_a_rotation_by_a_process_without_the_key_keeps_the_old_secret_and_says_so(
    database_url: str, receiver: Receiver, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="fluxora_webhooks")
    keys = keyring(new_key())
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        endpoint, secret = await endpoints.create(
            conn, url=receiver.url, tenant="nokey", allowed_networks=LOOPBACK, keys=keys
        )
        column, _, _ = await stored(database_url, endpoint.id)
        # A process the key was not given to (an API of the fleet, say) rotates it.
        _, rotated = await endpoints.rotate_secret(conn, endpoint.id, keys=NO_KEYS)
    new_column, moved, _ = await stored(database_url, endpoint.id)
    assert moved == column and new_column == rotated  # the old one as it was stored
    said = [r.getMessage() for r in caplog.records if endpoint.id in r.getMessage()]
    assert len(said) == 1, said
    assert "WEBHOOK_ENCRYPTION_KEY is not set here" in said[0] and "in plain text" in said[0]
    assert "secrets encrypt" in said[0] and secret not in said[0] and rotated not in said[0]
    # A dispatcher with the key signs with both: the old secret opens in secret_previous.
    await enqueue_many(database_url, 1, tenant="nokey")
    settings = make_settings("", allowed_networks=LOOPBACK, encryption_keys=keys)
    async with running_dispatcher(settings, database_url):
        await receiver.wait_for(1)
    hit = receiver.received[0]
    verify(hit.body, hit.headers, rotated, scheme="fluxora")
    verify(hit.body, hit.headers, rotated, scheme="standard")
    verify(hit.body, hit.headers, secret, scheme="standard")
    # `secrets encrypt` then seals the plain one, and leaves the sealed one as it is.
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        done = await endpoints.reseal_secrets(conn, keys)
    assert (done.changed, done.unchanged, done.unreadable) == (1, 1, [])
    assert keys.current is not None
    sealed, previous, _ = await stored(database_url, endpoint.id)
    assert sealed.startswith(f"fxenc:v1:{keys.current.id}:") and previous == column


async def test_a_lost_keys_secret_rotated_is_gone_and_encrypt_succeeds(
    database_url: str, receiver: Receiver
) -> None:
    """The documented way out of a lost key (`rotate-secret --keep-previous 0`) replaces
    the secret no key opens, so the endpoint is sent to at once with the new secret alone
    and `secrets encrypt` finds nothing unreadable. A rotation that would keep it is
    refused, changing nothing: the process rotating more often has another key than the
    dispatchers (it dropped a secret that still signed, and sealed the new one with a key
    they lack). A secret the keys open is kept as asked."""
    keep_ms = 0
    lost, here = keyring(new_key()), keyring(new_key())
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        endpoint, _ = await endpoints.create(
            conn, url=receiver.url, tenant="lost", allowed_networks=LOOPBACK, keys=lost
        )
        readable, _ = await endpoints.create(
            conn, url=receiver.url, tenant="other", allowed_networks=LOOPBACK, keys=here
        )
        before = await stored(database_url, endpoint.id)
        with pytest.raises(ConflictError, match="rotate from a process with that key"):
            await endpoints.rotate_secret(conn, endpoint.id, keep_previous_ms=3_600_000, keys=here)
        assert await stored(database_url, endpoint.id) == before
        freed, rotated = await endpoints.rotate_secret(
            conn, endpoint.id, keep_previous_ms=keep_ms, keys=here
        )
        kept, _ = await endpoints.rotate_secret(
            conn, readable.id, keep_previous_ms=3_600_000, keys=here
        )
        done = await endpoints.reseal_secrets(conn, here)
    _, previous, _ = await stored(database_url, endpoint.id)
    assert previous is None
    assert freed.previous_until is not None and freed.previous_until <= datetime.now(UTC)
    _, kept_previous, _ = await stored(database_url, readable.id)
    assert kept_previous is not None and kept_previous.startswith("fxenc:")
    assert kept.previous_until is not None and kept.previous_until > datetime.now(UTC)
    assert done.unreadable == [], done.unreadable
    await enqueue_many(database_url, 1, tenant="lost")
    settings = make_settings("", allowed_networks=LOOPBACK, encryption_keys=here)
    async with running_dispatcher(settings, database_url):
        await receiver.wait_for(1)
    (hit,) = receiver.received
    verify(hit.body, hit.headers, rotated, scheme="fluxora")
    verify(hit.body, hit.headers, rotated, scheme="standard")
    assert hit.headers["webhook-signature"].count("v1,") == 1  # the new secret's alone


async def test_an_endpoint_added_without_the_key_beside_encrypted_ones_is_said(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A process the key was not given to stored a new endpoint's secret in plain text,
    silently (a rotation by one said so); without encrypted secrets anywhere, nothing is
    said (plain text is the deployment's choice)."""
    caplog.set_level(logging.WARNING, logger="fluxora_webhooks")
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        plain, _ = await endpoints.create(
            conn, url="https://a.example.com/1", tenant="t", keys=NO_KEYS
        )
        assert not [r for r in caplog.records if plain.id in r.getMessage()]
        await endpoints.create(
            conn, url="https://a.example.com/2", tenant="t", keys=keyring(new_key())
        )
        added, secret = await endpoints.create(
            conn, url="https://a.example.com/3", tenant="t", keys=NO_KEYS
        )
    said = [r.getMessage() for r in caplog.records if added.id in r.getMessage()]
    assert len(said) == 1 and "stored in plain text" in said[0], said
    assert "WEBHOOK_ENCRYPTION_KEY is not set here" in said[0] and secret not in said[0]
