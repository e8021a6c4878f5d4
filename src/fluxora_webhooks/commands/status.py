"""``fluxora-webhooks status``: what the outbox and the consumer look like right now.

From PostgreSQL: the backlog (pending rows, rows due now, the age of the oldest due row,
when the next row falls due), dead letters waiting, and the attempts of the last minutes
by outcome (from ``processed_at`` and ``outcome``). From Redis, when ``WEBHOOK_URL`` names
the consumer: its shared circuit breaker and how many attempts its rate-limit window
holds. Redis being unreachable is reported, not an error. Read-only throughout.

A table on a terminal, ``--json`` for scripts.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

PROG = "fluxora-webhooks status"
OUTCOMES = ("delivered", "retry", "dead_letter")
# The status command may count further than the service's gauges do: it runs once.
COUNT_CAP = 1_000_000
REDIS_TIMEOUT_S = 1.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Show the backlog, dead letters, recent attempts by outcome and, when WEBHOOK_URL "
            "is set, the consumer's circuit breaker (from Redis)."
        ),
    )
    parser.add_argument(
        "--minutes",
        type=int,
        default=15,
        metavar="N",
        help="window of the recent attempts, in minutes (default 15)",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def command(args: argparse.Namespace, env: dict[str, str]) -> int:
    from ..cli import _engines, run_async
    from ..errors import ConfigError

    opts = build_parser().parse_args(args.rest)
    if opts.minutes < 1:
        raise ConfigError("--minutes", "must be at least 1")
    webhook_url = env.get("WEBHOOK_URL", "").strip()
    # Redis is only needed to show a consumer's breaker: without WEBHOOK_URL, do not even
    # start the embedded one.
    database_url, redis_url = _engines(env, redis=bool(webhook_url))
    threshold = _breaker_threshold(env)

    async def main() -> int:
        snapshot = await read_status(
            database_url,
            minutes=opts.minutes,
            webhook_url=webhook_url or None,
            redis_url=redis_url,
            redis_prefix=env.get("FLUXORA_REDIS_PREFIX", ""),
            breaker_threshold=threshold,
        )
        if opts.json:
            print(json.dumps(snapshot, indent=2, default=str))
        else:
            render(snapshot)
        return 0

    return run_async(main())


def _breaker_threshold(env: dict[str, str]) -> int | None:
    """The breaker threshold, read leniently (status is a diagnostic: a bad value of an
    unrelated variable must not hide the backlog). None when unknown."""
    raw = env.get("WEBHOOK_CIRCUIT_BREAKER_THRESHOLD", "").strip()
    if not raw:
        return 0  # the documented default: disabled
    return int(raw) if raw.isdigit() else None


# -- reading ----------------------------------------------------------------------------


async def read_status(
    database_url: str,
    *,
    minutes: int,
    webhook_url: str | None,
    redis_url: str | None,
    redis_prefix: str = "",
    breaker_threshold: int | None = None,
) -> dict[str, Any]:
    """Everything ``status`` shows, as a JSON-ready dict."""
    import psycopg
    from psycopg.rows import dict_row

    from ..migrations import check_schema
    from ..queries import query
    from ..service import read_backlog

    async with await psycopg.AsyncConnection.connect(
        database_url, autocommit=True, connect_timeout=10
    ) as conn:
        await check_schema(conn)
        backlog = await read_backlog(conn, COUNT_CAP)
        cur = conn.cursor(row_factory=dict_row)
        await cur.execute(query("recent_outcomes"), {"window_ms": minutes * 60_000})
        recent = await cur.fetchall()
        now_row = await (await conn.execute("SELECT now()")).fetchone()
    assert now_row is not None
    by_outcome = {r["outcome"]: r for r in recent}
    out: dict[str, Any] = {
        "at": now_row[0].isoformat(),
        "backlog": {
            "pending": backlog.pending,
            "due_now": backlog.due,
            "oldest_due_age_seconds": round(backlog.oldest_due_age_s, 3),
            "next_due_in_seconds": (
                None if backlog.next_due_in_s is None else round(backlog.next_due_in_s, 3)
            ),
            "estimated": backlog.capped,
        },
        "dead_letters": {"waiting": backlog.dead_letters},
        "recent": {
            "minutes": minutes,
            "attempts": {
                o: int(by_outcome[o]["attempts"]) if o in by_outcome else 0 for o in OUTCOMES
            },
            "duration_ms": {
                o: {"p50": _ms(by_outcome[o]["p50_ms"]), "p95": _ms(by_outcome[o]["p95_ms"])}
                for o in OUTCOMES
                if o in by_outcome
            },
            "last_at": (max(r["last_at"] for r in recent).isoformat() if recent else None),
        },
        "consumer": None,
    }
    if webhook_url:
        out["consumer"] = await read_consumer(
            webhook_url, redis_url, redis_prefix, breaker_threshold
        )
    return out


def _ms(value: Any) -> float | None:
    return None if value is None else round(float(value), 2)


async def read_consumer(
    webhook_url: str, redis_url: str | None, prefix: str, threshold: int | None
) -> dict[str, Any]:
    """The consumer's shared breaker and rate-limit window, read from Redis (never raises
    for Redis: an unreachable Redis is part of the answer)."""
    import asyncio

    from ..breaker import read_breaker_state
    from ..endpoints import redacted
    from ..logs import scrub
    from ..ratelimit import rate_limit_key
    from ..redis_connect import client_for

    consumer: dict[str, Any] = {
        "endpoint": redacted(webhook_url),
        "redis": {"url": scrub(redis_url) if redis_url else None, "reachable": False},
        "breaker": None,
        "rate_limit": None,
    }
    if not redis_url:
        consumer["redis"]["error"] = "REDIS_URL is not set"
        return consumer
    client = client_for(
        redis_url, socket_connect_timeout=REDIS_TIMEOUT_S, socket_timeout=REDIS_TIMEOUT_S
    )
    try:
        async with asyncio.timeout(3 * REDIS_TIMEOUT_S):
            seconds, micros = await client.time()
            now_ms = int(seconds) * 1000 + int(micros) // 1000
            state = await read_breaker_state(client, webhook_url, prefix)
            window = await client.zcount(rate_limit_key(webhook_url, prefix), now_ms - 999, "+inf")
    except Exception as exc:  # unreachable, auth, timeout: say so, do not fail
        text = scrub(str(exc)).strip()
        consumer["redis"]["error"] = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
        return consumer
    finally:
        await client.aclose()
    consumer["redis"]["reachable"] = True
    consumer["breaker"] = {
        "enabled": None if threshold is None else threshold > 0,
        "threshold": threshold,
        "state": state.state,
        "failures": state.failures,
        "reset_in_seconds": (
            round(max(0, state.reset_at_ms - now_ms) / 1000, 3) if state.state == "open" else None
        ),
        "probe_in_flight": bool(state.probe_token),
    }
    consumer["rate_limit"] = {"attempts_last_second": int(window)}
    return consumer


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
    from rich.console import Console
    from rich.table import Table

    console = Console(soft_wrap=False)
    console.print(f"fluxora-webhooks status at {snapshot['at']}")
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
        console.print(f"(more than {COUNT_CAP:,} rows: counts are estimates)")

    recent = snapshot["recent"]
    table = Table(title=f"Attempts in the last {recent['minutes']} min", title_justify="left")
    table.add_column("outcome")
    table.add_column("attempts", justify="right")
    table.add_column("p50 ms", justify="right")
    table.add_column("p95 ms", justify="right")
    for outcome in OUTCOMES:
        times = recent["duration_ms"].get(outcome, {})
        table.add_row(
            outcome,
            f"{recent['attempts'][outcome]:,}",
            _num(times.get("p50")),
            _num(times.get("p95")),
        )
    console.print(table)

    consumer = snapshot["consumer"]
    if consumer is None:
        console.print("consumer: WEBHOOK_URL is not set; breaker state not shown")
        return
    table = Table(title=f"Consumer {consumer['endpoint']}", show_header=False, title_justify="left")
    table.add_column("what")
    table.add_column("value")
    redis = consumer["redis"]
    if not redis["reachable"]:
        table.add_row("redis", f"unreachable: {redis.get('error') or 'no answer'}")
        console.print(table)
        return
    table.add_row("redis", f"ok ({redis['url']})")
    breaker = consumer["breaker"]
    table.add_row("circuit breaker", breaker["state"])
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


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"
