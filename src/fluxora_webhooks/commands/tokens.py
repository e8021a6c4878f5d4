"""``fluxora-webhooks tokens create|list|revoke``: the management API's tokens (SPEC 15).

A token is printed once, at creation, and stored as its sha256 only. ``--tenant T`` makes
a tenant's token (``--tenant ""``: the default tenant's), none an admin's; ``--read-only``
one that cannot change anything."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping

from .common import connect, engines, run_async

NAME = "tokens"
HELP = "create, list or revoke the management API's tokens"
DESCRIPTION = (
    "Tokens for the management API and the dashboard. An admin token (no --tenant) sees "
    "every tenant; a tenant's token only that tenant's endpoints, events and deliveries. "
    "The token is printed once and stored hashed; revoking it ends its dashboard sessions."
)


def configure(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="tokens_action", required=True, metavar="ACTION")
    p = actions.add_parser("create", help="a new token, printed once")
    p.add_argument("--name", required=True, help="a unique name (shown in lists and sessions)")
    p.add_argument(
        "--tenant",
        default=None,
        help="the tenant it acts for ('' for the default tenant); default: every tenant",
    )
    p.add_argument("--read-only", action="store_true", help="reads only: every write is 403")
    p.add_argument("--json", action="store_true", help='print {"name": ..., "token": ...}')
    p = actions.add_parser("list", help="the tokens (never the tokens themselves)")
    p.add_argument("--json", action="store_true")
    p = actions.add_parser("revoke", help="revoke a token by name")
    p.add_argument("name")
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    from .. import tokens

    database_url, _ = engines(env, redis=False)

    async def main() -> int:
        async with connect(database_url) as conn:
            if args.tokens_action == "create":
                token, text = await tokens.create(
                    conn, name=args.name, tenant=args.tenant, read_only=args.read_only
                )
                if args.json:
                    print(json.dumps({**token.as_json(), "token": text}))
                else:
                    scope = "every tenant" if token.tenant is None else f"tenant {token.tenant!r}"
                    mode = ", read-only" if token.read_only else ""
                    print(f"created token {token.name} ({scope}{mode}); shown once:")
                    print(text)
            elif args.tokens_action == "list":
                found = [t.as_json() for t in await tokens.list_tokens(conn)]
                _print_list(found, args.json)
            else:
                revoked = await tokens.revoke(conn, args.name)
                if args.json:
                    print(json.dumps(revoked.as_json()))
                else:
                    print(f"revoked {revoked.name}")
        return 0

    return run_async(main())


def _print_list(items: list[dict[str, object]], as_json: bool) -> None:
    if as_json:
        print(json.dumps(items, indent=2))
        return
    if not items:
        print("no tokens")
        return
    from rich.table import Table
    from rich.text import Text

    from ..terminal import console

    table = Table()
    for column in (
        "name",
        "scope",
        "tenant",
        "read_only",
        "created_at",
        "last_used_at",
        "revoked_at",
    ):
        table.add_column(column, overflow="fold")
    for item in items:
        table.add_row(
            *(
                Text("" if item[c] is None else str(item[c]))
                for c in (
                    "name",
                    "scope",
                    "tenant",
                    "read_only",
                    "created_at",
                    "last_used_at",
                    "revoked_at",
                )
            )
        )
    console(width=200).print(table)
