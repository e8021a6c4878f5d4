"""``fluxora-webhooks dlq``: list, show, replay (same delivery id) or purge dead letters."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from .common import EXIT_CONFIG, engines, positive_int, run_async

NAME = "dlq"
HELP = "list, show, replay or purge dead letters"

LIST_COLUMNS = (
    "delivery_id",
    "endpoint_id",
    "event_type",
    "stream_id",
    "attempts",
    "reason",
    "last_status",
    "dead_at",
    "state",
)


def configure(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="dlq_command", required=True, metavar="ACTION")
    p = actions.add_parser("list", help="dead letters, newest first")
    p.add_argument("--limit", type=positive_int, default=100)
    p.add_argument("--all", action="store_true", help="include replayed and purged ones")
    p.add_argument("--endpoint", metavar="ID", help="only this endpoint's")
    p.add_argument("--tenant", metavar="T", help="only this tenant's ('' for the default)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = actions.add_parser("show", help="one dead letter in full (payload, last error, response)")
    p.add_argument("id", help="delivery id (or dead-letter row id)")
    for action, text in (("replay", "send again, same delivery id"), ("purge", "discard")):
        p = actions.add_parser(action, help=text)
        p.add_argument("ids", nargs="*", metavar="DELIVERY_ID")
        p.add_argument("--all", action="store_true", help=f"{action} every dead letter")
        p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    from .. import deadletters

    database_url, _ = engines(env, redis=False)

    async def main() -> int:
        if args.dlq_command == "list":
            found = await deadletters.list_dead(
                database_url,
                limit=args.limit,
                include_all=args.all,
                endpoint_id=args.endpoint,
                tenant=args.tenant,
            )
            print_rows(found, LIST_COLUMNS, args.json)
            return 0
        if args.dlq_command == "show":
            found = await deadletters.show(database_url, args.id)
            if not found:
                print(f"no dead letter with id {args.id}", file=sys.stderr)
                return 1
            print(json.dumps(found, default=str, indent=2))
            return 0
        if not args.all and not args.ids:
            print(f"dlq {args.dlq_command}: name delivery ids, or --all", file=sys.stderr)
            return EXIT_CONFIG
        done, missing = await deadletters.replay_or_purge(
            database_url, args.dlq_command, args.ids, include_all=args.all
        )
        verb = "replayed" if args.dlq_command == "replay" else "purged"
        if args.json:
            print(json.dumps({verb: done, "not_found": missing}))
        else:
            for delivery_id in done:
                print(f"{verb} {delivery_id}")
            print(f"{len(done)} dead letter(s) {verb}")
        for key in missing:
            print(f"no waiting dead letter with id {key}", file=sys.stderr)
        return 1 if missing else 0

    return run_async(main())


def print_rows(rows: list[dict[str, Any]], columns: Sequence[str], as_json: bool) -> None:
    if as_json:
        print(json.dumps(rows, default=str, indent=2))
        return
    if not rows:
        print("no dead letters")
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(show_lines=False)
    for col in columns:
        table.add_column(col, overflow="fold")
    for row in rows:
        table.add_row(*("" if row[c] is None else str(row[c]) for c in columns))
    Console(width=max(160, os.get_terminal_size(1).columns if sys.stdout.isatty() else 200)).print(
        table
    )
