"""Endpoint secrets at rest as an operator drives them: a key from `secrets new-key`, given
as WEBHOOK_ENCRYPTION_KEY or its _FILE; `endpoints add` storing the secret encrypted and
`run` signing with it; `secrets encrypt` and `secrets decrypt` moving existing rows; a bad
key stopping start-up naming the variable, never showing the value."""

from __future__ import annotations

import json
from pathlib import Path

import psycopg
import pytest

from fluxora_webhooks.secretbox import keyring_from_env
from fluxora_webhooks.signing import verify
from tests.support.dispatch import rows, wait_until
from tests.support.procs import command_env, dispatcher_env, dispatchers, run_command, run_json
from tests.support.receiver import Receiver

pytestmark = pytest.mark.e2e

PLAIN = {
    "ep_a": "plain-secret-number-one-0123456789",
    "ep_b": "whsec_" + "Qk" * 21 + "Qg==",
}


async def _new_key() -> str:
    code, out = await run_command("secrets", "new-key", env=command_env())
    assert code == 0, out
    return out.strip()


async def _secrets(database_url: str) -> dict[str, tuple[str | None, str | None]]:
    found = await rows(
        database_url, "SELECT id, secret, secret_previous FROM webhook_endpoints ORDER BY id"
    )
    return {i: (s, p) for i, s, p in found}


async def test_encrypt_and_decrypt_move_the_stored_secrets(
    database_url: str, tmp_path: Path
) -> None:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        for endpoint_id, secret in PLAIN.items():
            await conn.execute(
                "INSERT INTO webhook_endpoints (id, url, secret) VALUES (%s, %s, %s)",
                (endpoint_id, "https://hooks.example.com/in", secret),
            )
        # A rotation's previous secret is stored too.
        await conn.execute(
            "UPDATE webhook_endpoints SET secret_previous = 'old-plain-secret-0123456789abc'"
            " WHERE id = 'ep_a'"
        )
    key = await _new_key()
    key_file = tmp_path / "key"
    key_file.write_text(key + "\n")
    env = command_env(DATABASE_URL=database_url, WEBHOOK_ENCRYPTION_KEY_FILE=str(key_file))
    code, done = await run_json("secrets", "encrypt", "--batch", "1", "--json", env=env)
    assert code == 0, done
    assert done == {
        "encrypted": 3,
        "reencrypted": 0,
        "unchanged": 0,
        "unreadable": 0,
        "unreadable_endpoints": [],
    }
    sealed = await _secrets(database_url)
    values = [v for pair in sealed.values() for v in pair if v is not None]
    assert len(values) == 3 and all(v.startswith("fxenc:v1:") for v in values)
    assert not any(plain in v for plain in PLAIN.values() for v in values)
    # Idempotent: nothing left to do, nothing rewritten.
    code, again = await run_json("secrets", "encrypt", "--json", env=env)
    assert code == 0 and (again["encrypted"], again["unchanged"]) == (0, 3), again
    assert await _secrets(database_url) == sealed
    # A sealed value copied to another endpoint (its id is sealed in) opens nowhere but
    # where it was sealed: not "encrypted already", said, left as it is, exit 1.
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "UPDATE webhook_endpoints SET secret_previous = %s WHERE id = 'ep_b'",
            (sealed["ep_a"][0],),
        )
    code, out = await run_command("secrets", "encrypt", "--json", env=env)
    (copied,) = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert code == 1 and (copied["unchanged"], copied["unreadable"]) == (3, 1), copied
    (found,) = copied["unreadable_endpoints"]
    assert (found["id"], found["value"]) == ("ep_b", "its previous secret"), found
    assert "does not open with that key (altered, or copied" in found["reason"], found
    code, out = await run_command("secrets", "encrypt", env=env)
    assert code == 1 and "endpoint ep_b: its previous secret, encrypted with key" in out, out
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute("UPDATE webhook_endpoints SET secret_previous = NULL WHERE id = 'ep_b'")
    # Another key cannot open them: said by endpoint and key id, left as they are, exit 1.
    other = command_env(DATABASE_URL=database_url, WEBHOOK_ENCRYPTION_KEY=await _new_key())
    code, out = await run_command("secrets", "decrypt", env=other)
    assert code == 1 and "endpoint ep_a: its secret is encrypted with key" in out, out
    assert "endpoint ep_a: its previous secret is encrypted with key" in out
    assert "3 could not be opened (below)" in out and key not in out, out
    assert await _secrets(database_url) == sealed
    # The way back, with the key as the previous one (it opens, never seals).
    back = command_env(DATABASE_URL=database_url, WEBHOOK_ENCRYPTION_KEY_PREVIOUS=key)
    code, out = await run_command("secrets", "decrypt", env=back)
    assert code == 0 and "decrypted 3 secret(s)" in out, out
    assert await _secrets(database_url) == {
        "ep_a": (PLAIN["ep_a"], "old-plain-secret-0123456789abc"),
        "ep_b": (PLAIN["ep_b"], None),
    }


@pytest.mark.parametrize(
    ("variable", "value", "problem"),
    [
        # Each bad form: tests/unit/test_secretbox.py. Here: every command stops on one.
        ("WEBHOOK_ENCRYPTION_KEY", "too-short-a-key", "decodes to 11 bytes"),
        ("WEBHOOK_ENCRYPTION_KEY_PREVIOUS", "c2VjcmV0LWJ1dC1vbmx5LTI0LWJ5dGVz", "decodes to 24"),
    ],
)
async def test_a_bad_key_stops_start_up_naming_the_variable(
    database_url: str, variable: str, value: str, problem: str
) -> None:
    env = dispatcher_env(database_url, "redis://127.0.0.1:1/0", "", "p:", **{variable: value})
    del env["WEBHOOK_URL"], env["WEBHOOK_SECRET"]
    for command in (("run",), ("api",), ("endpoints", "add", "--url", "https://a.example/")):
        code, out = await run_command(*command, env=env)
        assert code == 2, (command, out)
        assert f"configuration error: {variable}: " in out and problem in out, (command, out)
        assert not value.strip() or value.strip() not in out, (command, out)


async def test_a_bad_key_file_is_named_as_read_from_it(database_url: str, tmp_path: Path) -> None:
    path = tmp_path / "key"
    path.write_text("0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef\n")
    env = command_env(DATABASE_URL=database_url, WEBHOOK_ENCRYPTION_KEY_FILE=str(path))
    code, out = await run_command("secrets", "encrypt", env=env)
    assert code == 2 and "WEBHOOK_ENCRYPTION_KEY: decodes to 48 bytes" in out, out
    assert "(read from WEBHOOK_ENCRYPTION_KEY_FILE)" in out and "0123456789abcdef" not in out


async def test_run_signs_with_a_secret_endpoints_add_stored_encrypted(
    database_url: str, redis_url: str, prefix: str, receiver: Receiver, tmp_path: Path
) -> None:
    key = await _new_key()
    (tmp_path / "key").write_text(key)
    adding = command_env(
        DATABASE_URL=database_url,
        WEBHOOK_ENCRYPTION_KEY=key,
        WEBHOOK_ALLOWED_NETWORKS="127.0.0.0/8",
    )
    code, made = await run_json(
        "endpoints", "add", "--url", receiver.url, "--tenant", "t", "--json", env=adding
    )
    assert code == 0, made
    ((stored,),) = await rows(
        database_url, "SELECT secret FROM webhook_endpoints WHERE id = %s", (made["id"],)
    )
    assert stored.startswith("fxenc:v1:") and made["secret"] not in stored
    env = dispatcher_env(
        database_url,
        redis_url,
        "",
        prefix,
        WEBHOOK_ENCRYPTION_KEY_FILE=str(tmp_path / "key"),
        WEBHOOK_ALLOWED_NETWORKS="127.0.0.0/8",
    )
    del env["WEBHOOK_URL"], env["WEBHOOK_SECRET"]
    async with dispatchers(1, env, tmp_path) as procs:
        code, sent = await run_json(
            "send", "--tenant", "t", "--event", "thing.done", "--payload", '{"n": 1}', "--json",
            env=command_env(DATABASE_URL=database_url),
        )  # fmt: skip
        assert code == 0, sent

        async def arrived() -> bool:
            return len(receiver.received) >= 1

        await wait_until(arrived, timeout=20, what="the delivery")
        log = procs[0].log()
    hit = receiver.received[0]
    verify(hit.body, hit.headers, made["secret"], scheme="fluxora")
    verify(hit.body, hit.headers, made["secret"], scheme="standard")
    assert json.loads(hit.body) == {"n": 1}
    assert key not in log and made["secret"] not in log
    sealing = keyring_from_env({"WEBHOOK_ENCRYPTION_KEY": key}).current
    assert sealing is not None and f"secrets sealed with key {sealing.id}" in log
