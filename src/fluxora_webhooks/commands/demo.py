"""``fluxora-webhooks demo``: the whole system end to end, on the embedded engines unless
``DATABASE_URL`` / ``REDIS_URL`` say otherwise. See :mod:`fluxora_webhooks.demo`."""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping

import psycopg
from rich.console import Console

from ..errors import ConfigError
from ..logs import scrub
from ..settings import MAX_BIGINT, EngineSettings, shown_value
from ..terminal import cell
from .common import int_option, require_embedded, run_async

NAME = "demo"
HELP = "the whole system end to end on local engines"

DESCRIPTION = """\
Many endpoints end to end. Three tenants of a payment-streams application, five endpoints
(each with its own secret, event-type subscription and verifying consumer) and an operator
endpoint. Payment-stream writes (create, update, pause, cancel) each enqueue a stream.*
event for their tenant in the same transaction, a few of them rolled back. In five steps:
fan-out (each event to every subscribed endpoint of its tenant, no other); isolation and
auto-disable (one endpoint hangs, the others keep their speed, it is disabled after
WEBHOOK_DISABLE_AFTER, its deliveries parked, the operator told); re-enable (the parked
deliveries sent); recovery (dead letters re-queued with recover, same delivery ids);
per-stream ordering (a retrying head delays only its own stream). Every step is checked;
the summary lists the checks, and the demo exits 0 only when all of them held. Then it
starts the management API and dashboard (WEBHOOK_API_PORT, default 8080, or a free port)
and prints their URL and an admin token; with --serve on a terminal they keep running
until Ctrl-C.

Runs on the embedded PostgreSQL and Redis in $FLUXORA_HOME (default ./.fluxora) unless
DATABASE_URL / REDIS_URL are set. The demo clears and rewrites only what is its own (the
table demo_streams, the tenants fluxora-demo-* and their endpoints, the outbox and
dead-letter rows of its streams and tenants and the operator events about them), and
refuses a database whose outbox holds other pending events.
"""


MAX_RATE = 1_000_000.0
# Each step needs a few writes of every tenant.
MIN_EVENTS = 30
MAX_EVENTS = 1_000_000
MAX_TIMEOUT_S = 86_400
_DECIMAL = re.compile(r"[0-9]{1,9}(\.[0-9]{1,9})?", re.ASCII)


def _rate(text: str) -> float:
    # ASCII decimals only: float() would also take "inf", "nan", "1e999" and "1_0".
    stripped = text.strip()
    if not _DECIMAL.fullmatch(stripped) or float(stripped) > MAX_RATE:
        raise ConfigError(
            "--rate", f"must be a number from 0 to {MAX_RATE:,.0f}, got {shown_value(text)}"
        )
    return float(stripped)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--events",
        type=int_option("--events", low=MIN_EVENTS, high=MAX_EVENTS),
        default=300,
        metavar="N",
        help=f"stream writes, shared by the steps ({MIN_EVENTS} or more; 300)",
    )
    parser.add_argument(
        "--seed",
        type=int_option("--seed", low=0, high=MAX_BIGINT),
        default=1,
        help="seed of the write plan: same seed, same writes (1)",
    )
    parser.add_argument(
        "--rate",
        type=_rate,
        default=150.0,
        metavar="PER_S",
        help="stream writes per second, 0 for as fast as possible (150)",
    )
    parser.add_argument(
        "--timeout",
        type=int_option("--timeout", low=1, high=MAX_TIMEOUT_S),
        default=90,
        metavar="SECONDS",
        help="give up and report failure after this long (90)",
    )
    parser.add_argument(
        "--serve",
        action="store_true",
        help="afterwards, keep the dashboard and API running until Ctrl-C (on a terminal)",
    )
    parser.add_argument(
        "--no-live",
        action="store_true",
        help="plain progress lines instead of the live display (automatic when stdout is"
        " not a terminal)",
    )


async def _dashboard(
    console: Console, database_url: str, redis_url: str, env: Mapping[str, str], *, serve: bool
) -> None:
    """The dashboard over what the demo did: its URL and an admin token; kept running
    with --serve on a terminal (tests and CI get the URL and token, and the exit code)."""
    import importlib.util

    if importlib.util.find_spec("fastapi") is None:
        console.print("The dashboard needs fluxora-webhooks[api]; `make demo` installs it.")
        return
    from ..demo.dashboard import demo_token, describe, serve_until_interrupted, start_dashboard
    from ..settings import Settings

    settings = Settings.from_env(env)
    port = settings.api_port if settings.api_port is not None else 8080
    server = await start_dashboard(database_url, redis_url, settings.api_host, port)
    try:
        token = await demo_token(database_url)
        keep = serve and console.is_terminal
        for line in describe(server.url, token, keep, asked=serve):
            console.print(line, markup=False)
        if keep:
            await serve_until_interrupted(server)
    finally:
        await server.stop()


def run(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    from ..demo import DemoOptions, run_demo
    from ..demo.display import DemoDisplay, print_summary

    opts = args
    found = EngineSettings.from_env(env)
    found.check_redis()
    if found.database_url is None or found.redis_url is None:
        require_embedded("DATABASE_URL" if found.database_url is None else "REDIS_URL")
    options = DemoOptions(
        events=opts.events,
        seed=opts.seed,
        rate=opts.rate,
        timeout_s=float(opts.timeout),
        redis_prefix=found.redis_prefix,
    )
    # soft_wrap: progress lines stay whole lines when the output is a file or a pipe.
    console = Console(highlight=False, soft_wrap=True)
    database_url, redis_url, home = found.database_url, found.redis_url, found.home

    console.print(
        f"[bold]fluxora-webhooks demo[/]: many endpoints. {options.events} payment-stream"
        f" writes (seed {options.seed}) for 3 tenants, each enqueuing its webhook event in the"
        " same transaction; five steps, each checked."
    )
    from ..embedded import EmbeddedEngines, describe

    with EmbeddedEngines(home) as engines:
        notice = describe(home, postgres=database_url is None, redis=redis_url is None)
        if notice:
            console.print(notice, markup=False)
        if database_url is None and not (home / "postgres" / "PG_VERSION").exists():
            console.print("First run: initialising the embedded PostgreSQL (a few seconds).")
        database_url = database_url or engines.database_url()
        redis_url = redis_url or engines.redis_url()
        display = DemoDisplay(console, live=console.is_terminal and not opts.no_live)

        async def main() -> int:
            report = await run_demo(
                options, database_url=database_url, redis_url=redis_url, display=display
            )
            print_summary(console, report)
            await _dashboard(console, database_url, redis_url, env, serve=opts.serve)
            return 0 if report.ok else 1

        try:
            return run_async(main())
        except (psycopg.OperationalError, OSError) as exc:
            console.print(
                cell(f"fluxora-webhooks demo: the database is unreachable: {scrub(str(exc))}")
            )
            return 1
