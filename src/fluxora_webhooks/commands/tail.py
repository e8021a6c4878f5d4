"""``fluxora-webhooks tail``: attempts as they complete (SPEC 18).

Each attempt recorded from the start on, of one tenant and/or one endpoint when given (the
scope is in the query): its time, outcome, status code, duration, endpoint, event type,
delivery id and attempt number, and the stored error of a failed one. On a terminal, one
coloured line each; otherwise, or with ``--json``, one JSON object per line. Runs until
Ctrl-C, SIGTERM or SIGQUIT (Ctrl-\\; exit 0), or ``--limit`` attempts, or ``--for``
seconds. It polls the outbox (see :mod:`fluxora_webhooks.tooling`): the dispatcher does
nothing more for it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
from collections.abc import Callable, Mapping

from ..errors import ConfigError, NotFoundError
from ..host import STOP_SIGNALS
from ..settings import MAX_BIGINT
from ..tooling import Attempt
from .common import connect, engines, int_option, run_async

NAME = "tail"
HELP = "show attempts as they complete"
DESCRIPTION = (
    "Show delivery attempts as they complete (status, duration, delivery id), of every "
    "tenant or of one tenant or endpoint. JSON lines when not on a terminal or with --json."
)
POLL_S = 0.25
MAX_FOR_S = 30 * 86_400.0
_OUTCOME_STYLE = {"delivered": "green", "retry": "yellow", "dead_letter": "bold red"}


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or not 0 < value <= MAX_FOR_S:
        raise ConfigError("--for", f"must be a number of seconds above 0, at most {MAX_FOR_S:.0f}")
    return value


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tenant", default=None, help="only this tenant's ('' for the default)")
    parser.add_argument("--endpoint", default=None, metavar="ID", help="only this endpoint's")
    parser.add_argument(
        "--limit",
        type=int_option("--limit", low=1, high=MAX_BIGINT),
        default=None,
        metavar="N",
        help="stop after N attempts",
    )
    parser.add_argument(
        "--for", dest="duration", type=_seconds, default=None, metavar="SECONDS",
        help="stop after this many seconds",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="JSON lines, also on a terminal")


def run(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    from .. import endpoints
    from ..tooling import AttemptCursor, database_now

    tenant = None if args.tenant is None else endpoints.check_tenant(args.tenant, "--tenant")
    as_json = args.json or not sys.stdout.isatty()
    database_url, _ = engines(env, redis=False)

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, stop.set)
        if args.duration is not None:
            loop.call_later(args.duration, stop.set)
        try:
            return await tail(stop)
        finally:
            for sig in STOP_SIGNALS:
                loop.remove_signal_handler(sig)

    async def tail(stop: asyncio.Event) -> int:
        shown = 0
        async with connect(database_url) as conn:
            if args.endpoint is not None:
                found = await endpoints.get(conn, args.endpoint)
                if tenant is not None and found.tenant != tenant:
                    raise NotFoundError(f"no endpoint {args.endpoint!r} of tenant {tenant!r}")
            cursor = AttemptCursor(await database_now(conn), tenant, args.endpoint)
            print(f"tailing attempts of {_scope(tenant, args.endpoint)}; Ctrl-C to stop",
                  file=sys.stderr, flush=True)  # fmt: skip
            printer = _json_line if as_json else _pretty_printer()
            while not stop.is_set():
                for attempt in await cursor.poll(conn):
                    printer(attempt)
                    shown += 1
                    if args.limit is not None and shown >= args.limit:
                        return 0
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), POLL_S)
        return 0

    return run_async(main())


def _scope(tenant: str | None, endpoint: str | None) -> str:
    parts = []
    if tenant is not None:
        parts.append(f"tenant {tenant!r}")
    if endpoint is not None:
        parts.append(f"endpoint {endpoint!r}")
    return ", ".join(parts) or "every tenant"


def _json_line(attempt: Attempt) -> None:
    print(json.dumps(attempt.as_json()), flush=True)


def _pretty_printer() -> Callable[[Attempt], None]:
    from rich.text import Text

    from ..terminal import bounded, visible
    from ..terminal import console as make_console

    console = make_console(highlight=False, soft_wrap=True)

    def show(a: Attempt) -> None:
        # Stored text (event types, errors) is data: never markup, controls made visible.
        line = Text()
        line.append(a.at.astimezone().strftime("%H:%M:%S.%f")[:-3], style="dim")
        line.append(f"  {a.outcome:<11}", style=_OUTCOME_STYLE.get(a.outcome, ""))
        line.append(f" {a.status_code if a.status_code is not None else '-':>3}")
        duration = "-" if a.duration_ms is None else f"{a.duration_ms:,.1f} ms"
        line.append(f" {duration:>10}")
        line.append(f"  {bounded(visible(str(a.endpoint_id)), 32)}", style="cyan")
        line.append(f"  {bounded(visible(a.event_type), 40)}")
        line.append(f"  {a.delivery_id} #{a.attempt}", style="dim")
        if a.error and a.outcome != "delivered":
            line.append(f"  {bounded(visible(a.error), 100)}", style="red")
        console.print(line)

    return show
