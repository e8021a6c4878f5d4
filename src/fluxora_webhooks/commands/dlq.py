"""``fluxora-webhooks dlq``: list, show, replay (same delivery id) or purge dead letters.

``purge --all`` and ``replay --all`` act on every waiting dead letter at once, so they ask
first on a terminal and need ``--yes`` otherwise; naming delivery ids is explicit enough
and never asks. Stored text is shown as data (see :mod:`fluxora_webhooks.terminal`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from rich.text import Text

from ..errors import NotFoundError
from ..terminal import cell, console, visible
from .common import EXIT_CONFIG, check_database, confirm, connect, engines, int_option, run_async

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
# The widest a table shows a column (stored text can be any length; --json has it whole).
# Delivery ids are always shown in full.
COLUMN_WIDTHS = {"event_type": 40, "stream_id": 40, "reason": 32, "dead_at": 32, "state": 12}
DEFAULT_COLUMN_WIDTH = 40
MAX_LIST_LIMIT = 1_000_000


def configure(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="dlq_command", required=True, metavar="ACTION")
    p = actions.add_parser("list", help="dead letters, newest first")
    p.add_argument(
        "--limit",
        type=int_option("--limit", low=1, high=MAX_LIST_LIMIT),
        default=100,
        help=f"at most this many (default 100, at most {MAX_LIST_LIMIT:,})",
    )
    p.add_argument("--all", action="store_true", help="include replayed and purged ones")
    p.add_argument("--endpoint", metavar="ID", help="only this endpoint's")
    p.add_argument("--tenant", metavar="T", help="only this tenant's ('' for the default)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = actions.add_parser(
        "show",
        help="a delivery's dead letters in full (payload as stored, last error, response), as a"
        " JSON array: one element per time it was dead-lettered",
    )
    p.add_argument("id", help="delivery id (or dead-letter row id)")
    p.add_argument("--json", action="store_true", help="accepted: show prints JSON anyway")
    for action, text in (("replay", "send again, same delivery id"), ("purge", "discard")):
        p = actions.add_parser(action, help=text)
        p.add_argument("ids", nargs="*", metavar="DELIVERY_ID")
        p.add_argument("--all", action="store_true", help=f"{action} every dead letter")
        p.add_argument(
            "--yes", action="store_true", help="with --all: do not ask (needed off a terminal)"
        )
        p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    from .. import deadletters, endpoints
    from ..endpoints import check_tenant_filter

    if args.dlq_command == "list":
        check_tenant_filter(args.tenant)

    if args.dlq_command in ("replay", "purge") and args.all == bool(args.ids):
        # Neither, or both: --all would act on every dead letter, not the ones named.
        print(
            f"fluxora-webhooks: error: dlq {args.dlq_command}: name delivery ids, or --all"
            + (" (not both)" if args.all else ""),
            file=sys.stderr,
        )
        return EXIT_CONFIG
    wide = args.dlq_command in ("replay", "purge") and args.all
    if wide and not confirm(_ALL_QUESTIONS[args.dlq_command], yes=args.yes):
        print(f"dlq {args.dlq_command}: nothing done", file=sys.stderr)
        return 1
    database_url, _ = engines(env, redis=False)

    async def main() -> int:
        await check_database(database_url)
        if args.dlq_command == "list":
            found = await deadletters.list_dead(
                database_url,
                limit=args.limit,
                include_all=args.all,
                endpoint_id=args.endpoint,
                tenant=args.tenant,
            )
            if not found and args.endpoint is not None:
                # A removed endpoint's dead letters are listed under its id; an id that
                # names nothing (a typo) is said, as tail and recover say it.
                async with connect(database_url) as conn:
                    await endpoints.get(conn, args.endpoint)
            print_rows(found, LIST_COLUMNS, args.json)
            if len(found) == args.limit:  # more may be waiting: said, not left unsaid
                print(
                    f"the newest {args.limit} shown; there may be more (--limit N shows"
                    " more, `status` counts them)",
                    file=sys.stderr,
                )
            return 0
        if args.dlq_command == "show":
            found = await deadletters.show(database_url, args.id)
            if not found:  # said as every command says a missing id (LOG_FORMAT too)
                raise NotFoundError(f"no dead letter with id {visible(args.id)}")
            print(json.dumps(found, default=json_value, indent=2))
            return 0
        done, missing, parked = await deadletters.replay_or_purge(
            database_url, args.dlq_command, args.ids, include_all=args.all
        )
        verb = "replayed" if args.dlq_command == "replay" else "purged"
        # Replay leaves a dead letter of a removed endpoint where it is: said, not hidden
        # among the ids that match nothing, nor skipped in silence by --all.
        left: list[tuple[str, str]] = []  # (the key given, or the delivery id; endpoint)
        if args.dlq_command == "replay" and (missing or args.all):
            orphans = await deadletters.orphaned(database_url, missing, include_all=args.all)
            given = set(missing)
            left = [(r if r in given and d not in given else d, e) for d, r, e in orphans]
            matched = {key for d, r, _ in orphans for key in (d, r)}
            missing = [key for key in missing if key not in matched]
        if args.json:
            out: dict[str, Any] = {verb: done, "not_found": missing}
            if args.dlq_command == "replay":
                out["endpoint_removed"] = [{"id": k, "endpoint_id": e} for k, e in left]
                out["parked"] = parked
            print(json.dumps(out))
        else:
            waits = set(parked)
            for delivery_id in done:
                # Parked with its disabled endpoint's deliveries: sent once it is enabled.
                said = " (parked: its endpoint is disabled)" if delivery_id in waits else ""
                print(f"{verb} {delivery_id}{said}")
            print(
                f"{len(done)} dead letter(s) {verb}"
                + (
                    f"; {len(parked)} parked until their endpoints are enabled"
                    " (`endpoints enable ID`)"
                    if parked
                    else ""
                )
            )
        if args.all and left:
            print(
                f"{len(left)} dead letter(s) not replayed: their endpoints were removed"
                " (`dlq list` shows them, `dlq purge` discards them)",
                file=sys.stderr,
            )
        for key, endpoint_id in [] if args.all else left:
            print(
                f"dead letter {visible(key)} not replayed: its endpoint {visible(endpoint_id)}"
                " was removed (`dlq purge` discards it)",
                file=sys.stderr,
            )
        for key in missing:
            print(f"no waiting dead letter with id {visible(key)}", file=sys.stderr)
        return 1 if missing or (left and not args.all) else 0

    return run_async(main())


def json_value(value: Any) -> str:
    """A value JSON has no type for: a time in ISO 8601 (as the API and `status` write
    it), anything else as its text."""
    return value.isoformat() if isinstance(value, datetime) else str(value)


def print_rows(rows: list[dict[str, Any]], columns: Sequence[str], as_json: bool) -> None:
    if as_json:
        print(json.dumps(rows, default=json_value, indent=2))
        return
    if not rows:
        print("no dead letters")
        return
    from rich.table import Table

    table = Table(show_lines=False)
    for col in columns:
        # Ids are what an operator copies into `dlq replay/show`: never shrunk or cut.
        keep = {"delivery_id": 36, "endpoint_id": 27}.get(col)
        table.add_column(col, no_wrap=True, overflow="ellipsis", min_width=keep)
    for row in rows:
        # Text cells: stored text is never read as markup, its control characters visible.
        table.add_row(*(_cell(c, row.get(c)) for c in columns))
    # The terminal's width (COLUMNS honoured); a pipe gets rows that never wrap.
    width = None if sys.stdout.isatty() else 260
    console(width=width, highlight=False).print(table)


def _cell(column: str, value: Any) -> Text:
    if column == "delivery_id":
        return cell(value)
    return cell(value, COLUMN_WIDTHS.get(column, DEFAULT_COLUMN_WIDTH))


_ALL_QUESTIONS = {
    "purge": "dlq purge --all discards every waiting dead letter; go ahead?",
    "replay": "dlq replay --all sends every waiting dead letter again, at once; go ahead?",
}
