"""The endpoint commands as a user drives them (SPEC 10, 13): add, list, show, update,
disable, enable, rotate-secret, remove, recover and `dlq list --endpoint/--tenant`, each with
`--json`, the secret printed only at creation and rotation, bad input refused with exit 2
naming the option."""

from __future__ import annotations

from typing import Any

import pytest

from fluxora_webhooks import secretbox
from tests.support.dispatch import scalar
from tests.support.procs import command_env, run_command, run_json

pytestmark = pytest.mark.e2e

FIELDS = {
    "id", "tenant", "url", "event_types", "description", "headers", "rate_limit", "ordered",
    "state", "disabled_reason", "disabled_at", "created_at",
}  # fmt: skip


async def cli(env: dict[str, str], *args: str) -> tuple[int, Any]:
    return await run_json(*args, env=env)


async def test_the_endpoint_commands_end_to_end(database_url: str) -> None:
    env = command_env(DATABASE_URL=database_url, WEBHOOK_ALLOWED_NETWORKS="127.0.0.0/8")
    code, made = await cli(
        env, "endpoints", "add", "--url", "https://hooks.acme.example/in?token=abc",
        "--tenant", "acme", "--events", "stream.*,invoice.paid", "--description", "billing",
        "--header", "X-Team=blue", "--rate-limit", "5", "--ordered", "--json",
    )  # fmt: skip
    assert code == 0, made
    assert made["secret"].startswith("whsec_") and set(made) >= FIELDS
    endpoint_id = made["id"]
    assert made["event_types"] == ["stream.*", "invoice.paid"] and made["ordered"] is True
    assert made["headers"] == {"X-Team": "blue"} and made["rate_limit"] == 5
    code, other = await cli(env, "endpoints", "add", "--url", "https://b.example/", "--json")
    assert code == 0 and other["tenant"] == ""

    code, listed = await cli(env, "endpoints", "list", "--json")
    assert code == 0 and {e["id"] for e in listed} == {endpoint_id, other["id"]}
    assert all("secret" not in e for e in listed)
    code, mine = await cli(env, "endpoints", "list", "--tenant", "acme", "--json")
    assert [e["id"] for e in mine] == [endpoint_id]
    code, shown = await cli(env, "endpoints", "show", endpoint_id, "--json")
    assert code == 0 and shown["state"] == "enabled" and "secret" not in shown
    assert shown["disabled_reason"] is None and shown["url"].endswith("token=abc")

    code, updated = await cli(
        env, "endpoints", "update", endpoint_id, "--events", "*", "--no-ordered", "--json"
    )
    assert code == 0 and updated["event_types"] == ["*"] and updated["ordered"] is False
    code, out = await cli(env, "endpoints", "update", endpoint_id)  # nothing said to change
    assert code == 2 and "nothing to change" in out, out
    code, same = await cli(env, "endpoints", "show", endpoint_id, "--json")
    assert same == updated
    # A credential header is shown masked; given back masked, it keeps its value.
    code, keyed = await cli(
        env, "endpoints", "update", endpoint_id, "--header", "X-Api-Key=k-cli-s3cr3t",
        "--header", "X-Team=blue", "--json",
    )  # fmt: skip
    assert code == 0 and keyed["headers"] == {"X-Api-Key": "********", "X-Team": "blue"}
    code, text = await run_command("endpoints", "show", endpoint_id, env=env)
    assert code == 0 and "k-cli-s3cr3t" not in text and "********" in text
    code, kept = await cli(
        env, "endpoints", "update", endpoint_id, "--header", "X-Api-Key=********",
        "--header", "X-Team=red", "--json",
    )  # fmt: skip
    assert code == 0 and kept["headers"] == {"X-Api-Key": "********", "X-Team": "red"}
    stored = await scalar(
        database_url, "SELECT headers FROM webhook_endpoints WHERE id = %s", (endpoint_id,)
    )
    assert stored == {"X-Api-Key": "k-cli-s3cr3t", "X-Team": "red"}
    updated = kept
    code, off = await cli(env, "endpoints", "disable", endpoint_id, "--json")
    assert off["state"] == "disabled" and off["disabled_reason"] == "manual"
    assert off["disabled_at"]
    code, on = await cli(env, "endpoints", "enable", endpoint_id, "--json")
    assert on["state"] == "enabled" and on["disabled_reason"] is None

    code, rotated = await cli(env, "endpoints", "rotate-secret", endpoint_id, "--json")
    assert code == 0 and set(rotated) == {"id", "secret"} and rotated["secret"] != made["secret"]
    code, text = await run_command("endpoints", "show", endpoint_id, env=env)
    assert made["secret"] not in text and rotated["secret"] not in text

    # Dead letters of the endpoint, listed by endpoint and tenant, then recovered.
    await _dead_letters(database_url, endpoint_id, 12)
    code, dead = await cli(env, "dlq", "list", "--endpoint", endpoint_id, "--json")
    assert code == 0 and len(dead) == 12
    code, none = await cli(env, "dlq", "list", "--tenant", "bolt", "--json")
    assert none == []
    code, recovered = await cli(
        env, "recover", "--endpoint", endpoint_id, "--since", "2h", "--json"
    )
    assert code == 0 and recovered == {"requeued": 12, "parked": 0}
    code, again = await cli(
        env, "recover", "--endpoint", endpoint_id, "--since", "2026-01-01T00:00:00Z", "--json"
    )
    assert again == {"requeued": 0, "parked": 0}
    code, out = await run_command(
        "recover", "--endpoint", endpoint_id, "--since", "2099-01-01T00:00:00Z", env=env
    )
    assert code == 2 and "error: --since: is in the future" in out, out  # no --until given
    # Recovered into a disabled endpoint: parked, and the command says so.
    await cli(env, "endpoints", "disable", endpoint_id, "--json")
    await _dead_letters(database_url, endpoint_id, 3)
    code, out = await run_command("recover", "--endpoint", endpoint_id, "--since", "2h", env=env)
    assert code == 0 and "requeued 3 dead letter(s)" in out and "parked" in out, out
    assert f"endpoints enable {endpoint_id}" in out

    code, out = await run_command("endpoints", "remove", endpoint_id, env=env)
    assert code == 2 and "--yes" in out  # not on a terminal: asks for --yes
    code, gone = await cli(env, "endpoints", "remove", endpoint_id, "--yes", "--json")
    assert code == 0 and gone["dead_lettered"] == 15  # the recovered, pending or parked
    code, out = await run_command("endpoints", "show", endpoint_id, env=env)
    assert code == 1 and "no endpoint" in out


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["endpoints", "add", "--url", "http://hooks.example.com/"], "error: --url:"),
        (["endpoints", "add", "--url", "https://10.0.0.1/"], "error: --url:"),
        (
            ["endpoints", "add", "--url", "https://a.example/", "--header", "Content-Type=x"],
            "error: --header:",
        ),
        (["endpoints", "add", "--url", "https://a.example/", "--header", "nonsense"], "--header"),
        # Written as HTTP writes it: named, its value (a credential, often) not echoed.
        (
            ["endpoints", "add", "--url", "https://a.example/", "--header", "Authorization: B k-9"],
            "'Authorization': write NAME=VALUE",
        ),
        (  # base64's padding is an "=": still not taken for NAME=VALUE, nor echoed
            ["endpoints", "add", "--url", "https://a.example/", "--header", "Authorization: k-9=="],
            "'Authorization': write NAME=VALUE",
        ),
        (["endpoints", "add", "--url", "https://a.example/", "--rate-limit", "0"], "--rate-limit"),
        (
            ["endpoints", "add", "--url", "https://a.example/", "--tenant", "a b"],
            "error: --tenant:",
        ),
        (
            ["endpoints", "add", "--url", "https://a.example/", "--secret", "short"],
            "error: --secret:",
        ),
        # An empty list (an unset shell variable, say) is not "every event type".
        (["endpoints", "add", "--url", "https://a.example/", "--events", ""], "error: --events:"),
        (["endpoints", "rotate-secret", "ep_x", "--keep-previous", "forever"], "--keep-previous"),
        (["recover", "--endpoint", "ep_x", "--since", "yesterday"], "--since"),
        # A mistyped tenant to list by is named, not answered with an empty list.
        (["endpoints", "list", "--tenant", "a b"], "--tenant"),
        (["dlq", "list", "--tenant", "a b"], "--tenant"),
    ],
)
async def test_bad_input_is_refused_naming_what_is_wrong(
    database_url: str, args: list[str], named: str
) -> None:
    code, out = await run_command(*args, env=command_env(DATABASE_URL=database_url))
    assert code == 2, out
    assert named in out and "Traceback" not in out
    assert "k-9" not in out
    assert await scalar(database_url, "SELECT count(*) FROM webhook_endpoints") == 0


async def test_a_secret_that_starts_with_a_dash_is_taken(database_url: str) -> None:
    """secrets.token_urlsafe (examples/README.md's recipe) starts one secret in 64 with "-";
    argparse took it for an option and failed with "expected one argument"."""
    env = command_env(DATABASE_URL=database_url)
    dashed, doubled = "-RqHswvnU6VTcfC41dLkd27GIJ2YyDVKO4mThEAwi_Y", "--" + "k" * 40
    code, made = await cli(
        env, "endpoints", "add", "--url", "https://a.example/", "--secret", dashed, "--json"
    )
    assert code == 0 and made["secret"] == dashed, made
    code, rotated = await cli(
        env, "endpoints", "rotate-secret", made["id"], "--secret", doubled, "--json"
    )
    assert code == 0 and rotated == {"id": made["id"], "secret": doubled}, rotated
    code, other = await cli(
        env, "endpoints", "add", "--url", "https://b.example/", f"--secret={dashed}", "--json"
    )
    assert code == 0 and other["secret"] == dashed, other
    # A value left out is still a usage error: the next option is not taken for it.
    code, out = await run_command(
        "endpoints", "add", "--url", "https://c.example/", "--secret", "--json", env=env
    )
    assert code == 2 and "argument --secret: expected one argument" in out, out
    assert await scalar(database_url, "SELECT count(*) FROM webhook_endpoints") == 2


async def _dead_letters(database_url: str, endpoint_id: str, n: int) -> None:
    """``n`` dead letters of the endpoint (tenant acme), dead an hour ago."""
    await scalar(
        database_url,
        "INSERT INTO webhook_dead_letter (delivery_id, stream_id, event_type, payload,"
        " attempts, reason, enqueued_at, dead_at, endpoint_id, tenant)"
        " SELECT gen_random_uuid(), 's' || g, 'stream.updated', '{}', 8,"
        " 'attempts_exhausted', now(), now() - interval '1 hour', %s, 'acme'"
        " FROM generate_series(1, %s) g RETURNING 1",
        (endpoint_id, n),
    )


async def test_a_tenants_text_cannot_drive_the_operators_terminal(database_url: str) -> None:
    """A description a tenant set through the API (which takes control characters) is
    shown by `endpoints show`, `update` and `list` with its control characters escaped: a
    clipboard write (OSC 52), a title change or a cursor move that redraws an earlier line
    (a forged "state disabled") is text, as `dlq show` and `tail` show it."""
    env = command_env(DATABASE_URL=database_url)
    hostile = "\x1b]52;c;ZWNobyBwd25lZA==\x07\x1b[1A\x1b[2Kstate            disabled"
    code, made = await cli(
        env, "endpoints", "add", "--url", "https://a.example/", "--tenant", "t", "--json"
    )
    assert code == 0, made
    await scalar(
        database_url,
        "UPDATE webhook_endpoints SET description = %s WHERE id = %s RETURNING 1",
        (hostile, made["id"]),
    )
    code, shown = await run_command("endpoints", "show", made["id"], env=env)
    assert code == 0 and "\x1b" not in shown and "\x07" not in shown, shown
    assert "\\x1b]52;c;ZWNobyBwd25lZA==\\x07\\x1b[1A\\x1b[2Kstate" in shown, shown
    code, updated = await run_command(
        "endpoints", "update", made["id"], "--rate-limit", "5", env=env
    )
    assert code == 0 and "\x1b" not in updated and "\\x1b[2K" in updated, updated
    code, listed = await run_command("endpoints", "list", env=env)
    assert code == 0 and "\x1b" not in listed, listed
    # --json carries the text as it is stored (JSON escapes it).
    code, as_json = await cli(env, "endpoints", "show", made["id"], "--json")
    assert code == 0 and as_json["description"] == hostile, as_json


async def test_add_with_an_idempotency_key_adds_once(database_url: str) -> None:
    """A script that runs `endpoints add` again (it did not see the first run's answer)
    with the same key gets the endpoint the first run added, with its secret while it was
    not rotated, not a second endpoint; other options with the key are refused."""
    env = command_env(DATABASE_URL=database_url)
    add = ("endpoints", "add", "--url", "https://hooks.acme.example/in", "--tenant", "acme")
    key = ("--idempotency-key", "provision-acme-1")
    code, first = await cli(env, *add, *key, "--json")
    assert code == 0, first
    code, again = await cli(env, *add, *key, "--json")
    assert code == 0, again
    assert again["id"] == first["id"] and again["secret"] == first["secret"]
    assert again["replayed"] is True and "replayed" not in first
    count = "SELECT count(*) FROM webhook_endpoints WHERE tenant = 'acme'"
    assert await scalar(database_url, count) == 1
    code, out = await run_command(*add, *key, env=env)  # as a person reads it
    assert code == 0 and f"added before with this key: {first['id']}" in out, out
    assert first["secret"] in out and "shown once" not in out
    code, out = await run_command(*add, "--description", "other", *key, env=env)
    assert code == 1 and "another request" in out and "url, event types" in out, out
    assert await scalar(database_url, count) == 1
    code, _ = await cli(env, "endpoints", "rotate-secret", first["id"], "--json")
    assert code == 0
    code, out = await run_command(*add, *key, env=env)
    assert code == 0 and "rotated since; not shown again" in out, out
    assert first["secret"] not in out
    code, out = await run_command(*add, "--idempotency-key", "two words", env=env)
    assert code == 2 and "--idempotency-key" in out and "visible ASCII" in out, out


async def test_add_again_without_the_key_that_sealed_its_secret(database_url: str) -> None:
    """`endpoints add --idempotency-key` run again where WEBHOOK_ENCRYPTION_KEY is not set
    cannot show a secret sealed with it: it says so, not that it was rotated."""
    key_text = secretbox.new_key()
    sealed = command_env(DATABASE_URL=database_url, WEBHOOK_ENCRYPTION_KEY=key_text)
    add = ("endpoints", "add", "--url", "https://hooks.acme.example/in", "--tenant", "acme")
    key = ("--idempotency-key", "provision-sealed")
    code, first = await cli(sealed, *add, *key, "--json")
    assert code == 0 and first["secret"], first
    code, out = await run_command(*add, *key, env=command_env(DATABASE_URL=database_url))
    assert code == 0 and f"added before with this key: {first['id']}" in out, out
    assert "rotated" not in out and "encrypted with a key this process does not have" in out
    assert first["secret"] not in out
    code, out = await run_command(*add, *key, env=sealed)  # with the key: shown again
    assert code == 0 and first["secret"] in out, out
