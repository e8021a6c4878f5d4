"""``fluxora-webhooks recover --endpoint ID --since TIME [--until TIME]``: put an endpoint's
dead letters from a window back into the outbox (SPEC 13), in bounded batches, with no cap
on how many. TIME is ISO 8601 or a duration ago (``2h``)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping

from .common import as_options, connect, engines, run_async

NAME = "recover"
HELP = "re-queue an endpoint's dead letters from a time window"
DESCRIPTION = (
    "Re-queue every delivery of an endpoint that was dead-lettered in the window (same "
    "delivery id, attempts counted afresh). TIME is ISO 8601 (2026-12-01T10:00:00Z; a time "
    "without an offset is UTC) or a duration ago (90m, 2h, 3d)."
)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint", required=True, metavar="ID")
    parser.add_argument("--since", required=True, metavar="TIME")
    parser.add_argument("--until", metavar="TIME", help="the end of the window (default: now)")
    parser.add_argument("--json", action="store_true", help='print {"requeued": N, "parked": N}')


def run(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    from .. import endpoints

    database_url, _ = engines(env, redis=False)

    async def main() -> int:
        async with connect(database_url) as conn:
            since = await endpoints.moment(conn, args.since, "--since")
            until = await endpoints.moment(conn, args.until, "--until") if args.until else None
            count = await endpoints.recover(conn, args.endpoint, since=since, until=until)
            # Re-queued into a disabled endpoint, they are parked: said, not left to guess.
            parked = count if not (await endpoints.get(conn, args.endpoint)).enabled else 0
        if args.json:
            print(json.dumps({"requeued": count, "parked": parked}))
        elif parked:
            print(
                f"requeued {count} dead letter(s) of {args.endpoint}, parked: the endpoint "
                f"is disabled (`fluxora-webhooks endpoints enable {args.endpoint}` sends them)"
            )
        else:
            print(f"requeued {count} dead letter(s) of {args.endpoint}")
        return 0

    return as_options(lambda: run_async(main()))
