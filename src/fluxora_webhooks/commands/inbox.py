"""``fluxora-webhooks inbox``: the consumer's inbox in the consumer's ``DATABASE_URL``.

- ``inbox install``: create ``webhook_inbox`` (idempotent; :func:`fluxora_webhooks.inbox.install`).
- ``inbox prune --older-than 30d``: delete the delivery ids received before then, in short
  batches, alongside the running consumer. A period under two days is refused without
  ``--force``: the sender retries for about a day and a half, and an id forgotten before
  its last retry arrives lets that retry apply the event again.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .common import engines, int_option, run_async

if TYPE_CHECKING:
    from ..inbox import Installed

NAME = "inbox"
HELP = "the consumer's inbox: install its table, prune old delivery ids"
DESCRIPTION = (
    "The transactional inbox of a webhook consumer (docs/consumers.md), in the "
    "database named by DATABASE_URL."
)

# Longer than the default retry window (5s+5m+30m+2h+5h+10h+10h, plus 20 % jitter: ~33 h).
MIN_SAFE_PERIOD_MS = 2 * 86_400_000


def configure(parser: argparse.ArgumentParser) -> None:
    from ..inbox import DEFAULT_PRUNE_BATCH, MAX_PRUNE_BATCH

    actions = parser.add_subparsers(dest="inbox_action", required=True, metavar="ACTION")
    p = actions.add_parser("install", help="create the webhook_inbox table (idempotent)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = actions.add_parser("prune", help="delete delivery ids older than a period")
    p.add_argument(
        "--older-than",
        required=True,
        metavar="PERIOD",
        help="age of the ids to delete, e.g. 30d (units ms, s, m, h, d); keep them longer "
        "than the sender retries and may replay",
    )
    p.add_argument(
        "--batch-size",
        type=int_option("--batch-size", low=1, high=MAX_PRUNE_BATCH),
        default=DEFAULT_PRUNE_BATCH,
        metavar="N",
        help=f"rows per transaction (default {DEFAULT_PRUNE_BATCH}, at most {MAX_PRUNE_BATCH})",
    )
    p.add_argument(
        "--force", action="store_true", help="allow a period shorter than two days (unsafe)"
    )
    p.add_argument(
        "--dry-run", action="store_true", help="count what would be deleted; delete nothing"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace, env: Mapping[str, str]) -> int:

    from ..errors import ConfigError
    from ..inbox import install_report, prune
    from ..pgtypes import open_session
    from ..settings import parse_duration_ms

    older_than_ms = 0
    if args.inbox_action == "prune":
        older_than_ms = parse_duration_ms(args.older_than, "--older-than")
        if older_than_ms == 0:  # as the outbox's prune: a slip, not "everything", --force or not
            raise ConfigError(
                "--older-than", "must be more than 0 (0 would forget every delivery id at once)"
            )
        if older_than_ms < MIN_SAFE_PERIOD_MS and not args.force:
            raise ConfigError(
                "--older-than",
                "under 2d would forget ids the sender may still retry (events applied "
                "twice); pass --force if that is really meant",
            )
    database_url, _ = engines(env, redis=False)

    async def main() -> int:
        async with await open_session(database_url, autocommit=True, connect_timeout=10) as conn:
            if args.inbox_action == "install":
                done = await install_report(conn)
                _report(
                    {"created": done.created, "added_columns": list(done.added)},
                    args.json,
                    _installed_text(done),
                )
                return 0
            result = await prune(
                conn,
                older_than_ms=older_than_ms,
                batch_size=args.batch_size,
                dry_run=args.dry_run,
            )
        verb = "would delete" if result.dry_run else "deleted"
        text = (
            f"{verb} {result.deleted} delivery id(s) received before "
            f"{result.cutoff.isoformat(timespec='seconds')}"
        )
        if not result.dry_run:
            text += f" in {result.batches} batch(es) of at most {args.batch_size}"
        _report(result.as_dict(), args.json, text)
        return 0

    return run_async(main())


def _installed_text(done: Installed) -> str:
    if done.created:
        return "created webhook_inbox"
    if done.added:
        return f"webhook_inbox was there; added its missing column(s): {', '.join(done.added)}"
    return "webhook_inbox is already installed"


def _report(data: dict[str, Any], as_json: bool, text: str) -> None:
    print(json.dumps(data) if as_json else text)
