"""The sealing of endpoint secrets at rest (secretbox): the key's forms, the stored form,
and what opens it."""

from __future__ import annotations

import base64
import os
import random

import pytest

from fluxora_webhooks import logs
from fluxora_webhooks.errors import ConfigError
from fluxora_webhooks.secretbox import SecretLocked, key_id, keyring_from_env, new_key, parse_key


def test_a_key_is_taken_in_every_base64_form_of_32_bytes() -> None:
    raw = os.urandom(32)
    forms = {
        base64.b64encode(raw).decode(),
        base64.b64encode(raw).decode().rstrip("="),
        base64.urlsafe_b64encode(raw).decode(),
        base64.urlsafe_b64encode(raw).decode().rstrip("=") + "\n",
    }
    assert len({parse_key(form, "K").id for form in forms}) == 1
    assert parse_key(new_key(), "K").id != parse_key(new_key(), "K").id


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("", "is set but empty"),
        ("!" * 44, "is not base64"),
        (base64.b64encode(bytes(range(16))).decode(), "decodes to 16 bytes"),
        (bytes(range(100, 132)).hex(), "decodes to 48 bytes"),
        (base64.b64encode(bytes(32)).decode(), "is not a random key"),
    ],
    ids=["empty", "not-base64", "16-bytes", "hex", "one-byte-repeated"],
)
def test_a_bad_key_names_the_variable_and_never_the_value(value: str, problem: str) -> None:
    with pytest.raises(ConfigError) as caught:
        keyring_from_env({"WEBHOOK_ENCRYPTION_KEY": value})
    assert caught.value.variable == "WEBHOOK_ENCRYPTION_KEY" and problem in str(caught.value)
    assert not value or value not in str(caught.value)


def test_a_sealed_secret_opens_for_its_endpoint_with_its_key_only() -> None:
    old, new = new_key(), new_key()
    sealing = keyring_from_env({"WEBHOOK_ENCRYPTION_KEY": old})
    assert sealing.current is not None
    stored = sealing.seal("whsec_the-secret", "ep_1")
    assert stored.startswith(f"fxenc:v1:{sealing.current.id}:") and "the-secret" not in stored
    assert sealing.seal("whsec_the-secret", "ep_1") != stored  # a nonce of its own
    assert sealing.open(stored, "ep_1") == "whsec_the-secret"
    assert sealing.open("a-plain-secret-of-old", "ep_1") == "a-plain-secret-of-old"
    with pytest.raises(SecretLocked) as moved:
        sealing.open(stored, "ep_2")  # bound to its endpoint
    assert moved.value.key_id == sealing.current.id
    rotated = keyring_from_env(
        {"WEBHOOK_ENCRYPTION_KEY": new, "WEBHOOK_ENCRYPTION_KEY_PREVIOUS": old}
    )
    assert rotated.open(stored, "ep_1") == "whsec_the-secret"
    assert not rotated.sealed_with_current(stored)
    with pytest.raises(SecretLocked, match=sealing.current.id):
        keyring_from_env({"WEBHOOK_ENCRYPTION_KEY": new}).open(stored, "ep_1")
    # The previous key alone opens, and never seals.
    previous_only = keyring_from_env({"WEBHOOK_ENCRYPTION_KEY_PREVIOUS": old})
    assert previous_only.open(stored, "ep_1") == "whsec_the-secret"
    assert previous_only.seal("whsec_x", "ep_1") == "whsec_x"


def test_the_keys_are_scrubbed_wherever_they_are_read() -> None:
    # Read by the supervisor, `api`, the commands and the API as well as by the service:
    # whatever any of them logs (a traceback, a library's debug line) never shows a key.
    current = base64.b64encode(os.urandom(32)).decode()  # padded, standard alphabet
    previous = new_key()
    keyring_from_env(
        {"WEBHOOK_ENCRYPTION_KEY": f" {current}\n", "WEBHOOK_ENCRYPTION_KEY_PREVIOUS": previous}
    )
    for key in (current, current.rstrip("="), previous, previous.rstrip("=")):
        assert logs.scrub(f"failed with key={key}!") == f"failed with key={logs.MASK}!"


def test_two_keys_of_one_key_id_are_refused() -> None:
    # A key id is 8 hex digits: two keys may share one (about 1 in 2**32). Rotating to
    # such a key would leave the previous key's values looking sealed with the current.
    rng, seen = random.Random(0), {}
    while (key := rng.randbytes(32)) and (found := key_id(key)) not in seen:
        seen[found] = key
    first, second = (base64.b64encode(k).decode() for k in (seen[found], key))
    sealed = keyring_from_env({"WEBHOOK_ENCRYPTION_KEY": first}).seal("whsec_s", "ep_1")
    with pytest.raises(ConfigError) as caught:
        keyring_from_env(
            {"WEBHOOK_ENCRYPTION_KEY": second, "WEBHOOK_ENCRYPTION_KEY_PREVIOUS": first}
        )
    assert caught.value.variable == "WEBHOOK_ENCRYPTION_KEY"
    assert f"same key id ({found})" in str(caught.value) and "secrets new-key" in str(caught.value)
    assert first not in str(caught.value) and second not in str(caught.value)
    # The same key twice is no rotation: it opens what it sealed.
    same = keyring_from_env(
        {"WEBHOOK_ENCRYPTION_KEY": first, "WEBHOOK_ENCRYPTION_KEY_PREVIOUS": first}
    )
    assert same.open(sealed, "ep_1") == "whsec_s"
