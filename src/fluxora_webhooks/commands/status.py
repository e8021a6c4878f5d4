"""``fluxora-webhooks status``: what the outbox and the consumer look like right now.

From PostgreSQL: the backlog (pending rows, rows due now, the age of the oldest due row,
when the next row falls due, the deliveries an egress proxy's outage holds), dead letters
waiting, the attempts of the last minutes
by outcome (from ``processed_at`` and ``outcome``), and the worst endpoints (disabled by
the dispatcher, failing longest, largest backlog: pending and parked deliveries, failure
streak, state and last error). From Redis, when ``WEBHOOK_URL`` names
the consumer: its shared circuit breaker and how many attempts its rate-limit window
holds. Redis being unreachable is reported, not an error; a ``REDIS_URL`` Redis refuses (its
password, the user's ACL, TLS not verified) is one (exit 2). Read-only throughout.

A table on a terminal, ``--json`` for scripts.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError
from ..ops import RECORDED_OUTCOMES, STATUS_COUNT_CAP, STATUS_ENDPOINTS, read_status
from ..settings import MAX_BREAKER_THRESHOLD, parse_int
from ..terminal import cell
from ..terminal import console as make_console
from .common import engines, int_option, run_async

# Ten years: far beyond any history kept, well inside what a PostgreSQL interval holds.
MAX_MINUTES = 3650 * 1440

NAME = "status"
HELP = "backlog, dead letters, recent outcomes, worst endpoints and breaker state"
DESCRIPTION = (
    "Show the backlog, dead letters, recent attempts by outcome, the worst endpoints and, "
    "when WEBHOOK_URL is set, the consumer's circuit breaker (from Redis)."
)
MAX_ENDPOINTS = 1000


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--minutes",
        type=int_option("--minutes", low=1, high=MAX_MINUTES),
        default=15,
        metavar="N",
        help=f"window of the recent attempts, in minutes (default 15, at most {MAX_MINUTES:,})",
    )
    parser.add_argument(
        "--endpoints",
        type=int_option("--endpoints", low=0, high=MAX_ENDPOINTS),
        default=STATUS_ENDPOINTS,
        metavar="N",
        help=f"how many of the worst endpoints to show (default {STATUS_ENDPOINTS}, 0: none)",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    opts = args
    webhook_url = env.get("WEBHOOK_URL", "").strip()
    # Redis is only needed to show a consumer's breaker: without WEBHOOK_URL, do not even
    # start the embedded one.
    database_url, redis_url = engines(env, redis=bool(webhook_url))
    threshold = _breaker_threshold(env)

    async def main() -> int:
        if webhook_url and redis_url:  # a REDIS_URL that can never work: exit 2
            await _check_redis(redis_url, webhook_url, env.get("FLUXORA_REDIS_PREFIX", ""))
        snapshot = await read_status(
            database_url,
            minutes=opts.minutes,
            webhook_url=webhook_url or None,
            redis_url=redis_url,
            redis_prefix=env.get("FLUXORA_REDIS_PREFIX", ""),
            breaker_threshold=threshold,
            endpoints=opts.endpoints,
        )
        if opts.json:
            print(json.dumps(snapshot, indent=2, default=str))
        else:
            render(snapshot)
        return 0

    return run_async(main())


async def _check_redis(redis_url: str, webhook_url: str, prefix: str) -> None:
    """The reads ``status`` makes of Redis, once: credentials refused, an ACL without one of
    them, TLS not verified stop it (ConfigError); Redis down is shown in the report."""
    from ..redis_connect import check_usable
    from ..redis_gate import breaker_key, rate_limit_key

    await check_usable(
        redis_url,
        [
            ("TIME",),
            ("HGETALL", breaker_key(webhook_url, prefix)),
            ("ZCOUNT", rate_limit_key(webhook_url, prefix), 0, 0),
        ],
    )


def _redis_problem(error: str | None) -> str:
    """Why Redis was not read: "unreachable" for an outage, "refused" for an answer that
    refused (credentials, an ACL, out of memory)."""
    from redis import exceptions

    if not error:
        return "unreachable: no answer"
    kind = getattr(exceptions, error.partition(":")[0], None)
    refused = isinstance(kind, type) and issubclass(
        kind, (exceptions.AuthenticationError, exceptions.ResponseError)
    )
    return f"{'refused' if refused else 'unreachable'}: {error}"


def _breaker_threshold(env: Mapping[str, str]) -> int | None:
    """The breaker threshold, read leniently (status is a diagnostic: a bad value of an
    unrelated variable must not hide the backlog). None when unknown."""
    raw = env.get("WEBHOOK_CIRCUIT_BREAKER_THRESHOLD", "").strip()
    if not raw:
        return 0  # the documented default: disabled
    try:  # the settings' parser: "²".isdigit() is true, and int() then raises
        return parse_int(
            raw, "WEBHOOK_CIRCUIT_BREAKER_THRESHOLD", low=0, high=MAX_BREAKER_THRESHOLD
        )
    except ConfigError:
        return None


# -- rendering --------------------------------------------------------------------------


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    total = round(seconds)
    if total < 60:
        return f"{seconds:.1f}s" if seconds < 10 else f"{total}s"
    minutes, secs = divmod(total, 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h {minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d {hours:02d}h"


def _count(value: int, estimated: bool) -> str:
    return f"~{value:,}" if estimated else f"{value:,}"


def render(snapshot: dict[str, Any]) -> None:
    from rich.table import Table

    # Not on a terminal (a pipe, a log): wide enough that no row of a table wraps.
    console = make_console(
        soft_wrap=False, highlight=False, width=None if sys.stdout.isatty() else 200
    )
    console.print(cell(f"fluxora-webhooks status at {snapshot['at']}"))
    backlog = snapshot["backlog"]
    estimated = bool(backlog["estimated"])
    table = Table(title="Outbox", show_header=False, title_justify="left")
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("pending", _count(backlog["pending"], estimated))
    table.add_row("due now", _count(backlog["due_now"], estimated))
    table.add_row(
        "oldest due", _age(backlog["oldest_due_age_seconds"]) if backlog["due_now"] else "-"
    )
    table.add_row("next due in", _age(backlog["next_due_in_seconds"]))
    table.add_row("dead letters waiting", f"{snapshot['dead_letters']['waiting']:,}")
    console.print(table)
    if estimated:
        console.print(f"(more than {STATUS_COUNT_CAP:,} rows: counts are estimates)")
    held = backlog["egress_held"]
    if held:
        # Counted up to the cap: at the cap, a lower bound.
        count = f"at least {held:,}" if held >= STATUS_COUNT_CAP else f"{held:,}"
        one = held == 1
        console.print(
            f"{count} deliver{'y' if one else 'ies'} held: this service's way out failed"
            " (the egress proxy, WEBHOOK_PROXY_URL, or its DNS lookups), so no consumer was"
            f" asked and no attempt is used; {'it is' if one else 'they are'} sent when it"
            " works again",
            soft_wrap=True,  # one line, as grep finds it; the terminal wraps it
        )

    recent = snapshot["recent"]
    table = Table(title=f"Attempts in the last {recent['minutes']} min", title_justify="left")
    table.add_column("outcome")
    table.add_column("attempts", justify="right")
    table.add_column("p50 ms", justify="right")
    table.add_column("p95 ms", justify="right")
    for outcome in RECORDED_OUTCOMES:
        times = recent["duration_ms"].get(outcome, {})
        table.add_row(
            outcome,
            f"{recent['attempts'][outcome]:,}",
            _num(times.get("p50")),
            _num(times.get("p95")),
        )
    console.print(table)
    unrouted = recent.get("unrouted_events", 0)
    if unrouted:
        console.print(
            f"{unrouted:,} event(s) in the last {recent['minutes']} min matched no endpoint of"
            " their tenant (recorded unrouted, sent nowhere)"
        )
    if snapshot.get("endpoints") is not None:
        _render_endpoints(console, snapshot["endpoints"])

    consumer = snapshot["consumer"]
    if consumer is None:
        console.print("consumer: WEBHOOK_URL is not set; breaker state not shown")
        return
    # What comes from Redis or the environment goes in as Text: never read as markup.
    table = Table(
        title=cell(f"Consumer {consumer['endpoint']}"), show_header=False, title_justify="left"
    )
    table.add_column("what")
    table.add_column("value")
    redis = consumer["redis"]
    if not redis["reachable"]:
        table.add_row("redis", cell(_redis_problem(redis.get("error")), 200))
        console.print(table)
        return
    table.add_row("redis", cell(f"ok ({redis['url']})", 200))
    breaker = consumer["breaker"]
    table.add_row("circuit breaker", cell(breaker["state"], 20))
    if breaker["enabled"] is False:
        table.add_row("", "disabled (WEBHOOK_CIRCUIT_BREAKER_THRESHOLD=0)")
    table.add_row("consecutive failures", str(breaker["failures"]))
    if breaker["reset_in_seconds"] is not None:
        table.add_row("probe allowed in", _age(breaker["reset_in_seconds"]))
    if breaker["probe_in_flight"]:
        table.add_row("probe", "in flight")
    attempts = consumer["rate_limit"]["attempts_last_second"]
    table.add_row("attempts in the last second", str(attempts))
    console.print(table)


def _render_endpoints(console: Any, endpoints: dict[str, Any]) -> None:
    from rich.table import Table

    console.print(
        f"Endpoints: {endpoints['total']:,} ({endpoints['disabled']:,} disabled,"
        f" {endpoints['failing']:,} failing), {endpoints['pending']:,} deliveries pending"
    )
    worst = endpoints["worst"]
    if not worst:
        return
    table = Table(title="Worst endpoints", title_justify="left")
    for column, justify in (
        ("endpoint", "left"), ("tenant", "left"), ("state", "left"), ("pending", "right"),
        ("parked", "right"), ("failing for", "right"), ("last error", "left"),
    ):  # fmt: skip
        table.add_column(
            column,
            justify=justify,  # type: ignore[arg-type]
            min_width=27 if column == "endpoint" else None,  # an id: never cut
        )
    for e in worst:
        state = e["state"] + (f" ({e['disabled_reason']})" if e["disabled_reason"] else "")
        last = e["last_error"]
        error = "-"
        if last is not None:
            error = " ".join(
                str(part) for part in (last["status_code"], last["error"]) if part is not None
            )
        tenant = {None: "(operator)", "": "(default)"}.get(e["tenant"], e["tenant"])
        table.add_row(
            cell(e["id"], 40),
            cell(tenant, 24),
            cell(state, 20),
            _count(e["pending"], e["pending_estimated"]),
            f"{e['parked']:,}",
            _age(e["failing_for_seconds"]),
            cell(error, 60),
        )
    console.print(table)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"
