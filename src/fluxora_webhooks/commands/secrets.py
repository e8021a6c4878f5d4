"""``fluxora-webhooks secrets``: the endpoints' secrets at rest (signing secrets, client
certificates' keys, credential header values; docs/security.md, "Secrets at rest").
``new-key`` prints a new ``WEBHOOK_ENCRYPTION_KEY``; ``encrypt`` stores every endpoint
secret sealed with it (plain ones, and those of
``WEBHOOK_ENCRYPTION_KEY_PREVIOUS`` after a key rotation); ``decrypt`` stores them all in
plain text again, before the key is dropped. Both go in batches, are idempotent and print
what they did."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

from .common import EXIT_FAILED, connect, engines, positive_int, run_async

if TYPE_CHECKING:
    from ..endpoints import Resealed
    from ..secretbox import Keyring

NAME = "secrets"
HELP = "encrypt the endpoints' secrets at rest (WEBHOOK_ENCRYPTION_KEY)"
DESCRIPTION = (
    "With WEBHOOK_ENCRYPTION_KEY set, new and rotated endpoint secrets (signing secrets,"
    " the private keys of endpoints' client certificates and the values of credential"
    " headers such as Authorization) are stored encrypted (AES-256-GCM). `new-key` prints"
    " a key; `encrypt` encrypts the secrets stored before"
    " (and re-encrypts those of WEBHOOK_ENCRYPTION_KEY_PREVIOUS with the current key);"
    " `decrypt` stores them in plain text again, for dropping the key."
)


def configure(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="secrets_action", required=True, metavar="ACTION")
    p = actions.add_parser("new-key", help="print a new WEBHOOK_ENCRYPTION_KEY")
    p.add_argument("--json", action="store_true", help='print {"key": ..., "key_id": ...}')
    for action, text in (
        ("encrypt", "encrypt every stored secret with WEBHOOK_ENCRYPTION_KEY"),
        ("decrypt", "store every secret in plain text again (before dropping the key)"),
    ):
        p = actions.add_parser(action, help=text)
        p.add_argument(
            "--batch",
            type=positive_int,
            default=500,
            metavar="N",
            help="endpoints per transaction (default 500)",
        )
        p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    from .. import secretbox

    if args.secrets_action == "new-key":
        key = secretbox.new_key()
        if args.json:
            parsed = secretbox.parse_key(key, "key")
            print(json.dumps({"key": key, "key_id": parsed.id}))
        else:
            print(key)
        return 0
    from .. import endpoints
    from ..errors import ConfigError

    keys = secretbox.keyring_from_env(env)
    plain = args.secrets_action == "decrypt"
    if plain and not keys.configured:
        raise ConfigError(
            secretbox.KEY_VARIABLE,
            f"(or {secretbox.PREVIOUS_KEY_VARIABLE}) is required to decrypt: set the key the"
            " secrets are encrypted with",
        )
    database_url, _ = engines(env, redis=False)

    async def main() -> int:
        async with connect(database_url) as conn:
            done = await endpoints.reseal_secrets(conn, keys, plain=plain, batch=args.batch)
        return _report(done, keys, plain=plain, as_json=args.json)

    return run_async(main())


def _report(done: Resealed, keys: Keyring, *, plain: bool, as_json: bool) -> int:
    unreadable = sorted(set(done.unreadable))
    if as_json:
        counts = (
            {"decrypted": done.changed}
            if plain
            else {"encrypted": done.changed - done.rekeyed, "reencrypted": done.rekeyed}
        )
        print(
            json.dumps(
                {
                    **counts,
                    "unchanged": done.unchanged,
                    "unreadable": len(done.unreadable),
                    "unreadable_endpoints": [
                        {"id": i, "key_id": k, "value": v, "reason": why}
                        for i, k, v, why in unreadable
                    ],
                }
            )
        )
    else:
        left = f"; {len(unreadable)} could not be opened (below)" if unreadable else ""
        if plain:
            print(
                f"decrypted {done.changed} secret(s); {done.unchanged} were in plain text"
                f" already{left}"
            )
        else:
            assert keys.current is not None
            print(
                f"encrypted {done.changed - done.rekeyed} plain secret(s) and re-encrypted"
                f" {done.rekeyed} with key {keys.current.id}; {done.unchanged} were encrypted"
                f" with it already{left}"
            )
    for endpoint_id, _, _, why in unreadable:
        print(f"fluxora-webhooks: endpoint {endpoint_id}: {why}: left as it is", file=sys.stderr)
    return EXIT_FAILED if unreadable else 0
