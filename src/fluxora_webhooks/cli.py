"""The ``fluxora-webhooks`` command: parses arguments and calls the library. Nothing more."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from . import __version__, logs
from .errors import ConfigError, FluxoraError, SchemaError

EXIT_CONFIG = 2
# Subcommands that live in fluxora_webhooks.commands.<name> and parse their own options.
EXTENSIONS = {
    "status": "backlog, dead letters, recent outcomes and breaker state",
    "prune": "delete processed rows older than a retention period",
    "demo": "the whole system end to end on local engines",
    "bench": "measure throughput and latency against the raw HTTP limit and a peer",
}
EXIT_SCHEMA = 3


def run_async(main: Coroutine[Any, Any, int]) -> int:
    """Run on uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
        return asyncio.run(main)
    return int(uvloop.run(main))


def _home(env: dict[str, str]) -> Path:
    return Path(env.get("FLUXORA_HOME", "").strip() or ".fluxora")


def _engines(env: dict[str, str], *, redis: bool) -> tuple[str, str | None]:
    from .engines import resolve

    database_url = env.get("DATABASE_URL", "").strip() or None
    redis_url = env.get("REDIS_URL", "").strip() or None
    if not redis and redis_url is None:
        redis_url = ""  # not needed: do not start an embedded Redis
    found = resolve(database_url, redis_url, _home(env))
    return found.database_url, (found.redis_url or None)


# -- commands ---------------------------------------------------------------------------


def cmd_migrate(args: argparse.Namespace, env: dict[str, str]) -> int:
    import psycopg

    from .migrations import latest_version, migrate

    database_url, _ = _engines(env, redis=False)

    async def main() -> int:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            applied = await migrate(conn)
        if applied:
            for m in applied:
                print(f"applied {m.version:04d}_{m.name}")
        else:
            print(f"schema is up to date (version {latest_version()})")
        return 0

    return run_async(main())


def cmd_run(args: argparse.Namespace, env: dict[str, str]) -> int:
    from .service import Service
    from .settings import Settings

    settings = Settings.from_env(env)
    logs.configure(settings.log_format)
    database_url, redis_url = _engines(env, redis=True)
    if settings.workers > 1:
        from .supervisor import Supervisor

        supervisor = Supervisor(settings, database_url=database_url, redis_url=redis_url, env=env)
        return run_async(_run_service(supervisor))
    service = Service(settings, database_url=database_url, redis_url=redis_url)
    return run_async(_run_service(service))


async def _run_service(service: Any) -> int:
    await service.run()
    return 0


def _print_rows(rows: list[dict[str, Any]], columns: Sequence[str], as_json: bool) -> None:
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


def cmd_dlq(args: argparse.Namespace, env: dict[str, str]) -> int:
    from . import deadletters

    database_url, _ = _engines(env, redis=False)

    async def main() -> int:
        if args.dlq_command == "list":
            found = await deadletters.list_dead(
                database_url, limit=args.limit, include_all=args.all
            )
            _print_rows(
                found,
                (
                    "delivery_id",
                    "event_type",
                    "stream_id",
                    "attempts",
                    "reason",
                    "last_status",
                    "dead_at",
                    "state",
                ),
                args.json,
            )
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


def _subcommand(name: str) -> Callable[[argparse.Namespace, dict[str, str]], int]:
    """Commands contributed by other modules (status, prune, demo, bench)."""
    import importlib

    module = importlib.import_module(f"fluxora_webhooks.commands.{name}")
    fn: Callable[[argparse.Namespace, dict[str, str]], int] = module.command
    return fn


def _positive_int(text: str) -> int:
    if not text.isascii() or not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fluxora-webhooks",
        description="Reliable webhooks from a PostgreSQL transactional outbox.",
    )
    parser.add_argument("--version", action="version", version=f"fluxora-webhooks {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("migrate", help="apply pending schema migrations (idempotent)")
    p.set_defaults(func=cmd_migrate)

    p = sub.add_parser("run", help="run the dispatcher (configuration from the environment)")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("dlq", help="list, show, replay or purge dead letters")
    dsub = p.add_subparsers(dest="dlq_command", required=True, metavar="ACTION")
    d = dsub.add_parser("list", help="dead letters, newest first")
    d.add_argument("--limit", type=_positive_int, default=100)
    d.add_argument("--all", action="store_true", help="include replayed and purged ones")
    d.add_argument("--json", action="store_true", help="machine-readable output")
    d = dsub.add_parser("show", help="one dead letter in full (payload, last error, response)")
    d.add_argument("id", help="delivery id (or dead-letter row id)")
    for action, text in (("replay", "send again, same delivery id"), ("purge", "discard")):
        d = dsub.add_parser(action, help=text)
        d.add_argument("ids", nargs="*", metavar="DELIVERY_ID")
        d.add_argument("--all", action="store_true", help=f"{action} every dead letter")
        d.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_dlq)

    for name, text in EXTENSIONS.items():
        sub.add_parser(name, help=text, add_help=False)  # listed in --help; see main()
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    env = dict(os.environ)
    logs.configure(env.get("LOG_FORMAT", "text").strip().lower() or "text")
    parser = build_parser()
    try:
        if argv and argv[0] in EXTENSIONS:
            # These parse their own options (argparse's REMAINDER would refuse a leading "-").
            return _subcommand(argv[0])(argparse.Namespace(command=argv[0], rest=argv[1:]), env)
        args = parser.parse_args(argv)
        code: int = args.func(args, env)
        return code
    except ConfigError as exc:
        print(f"fluxora-webhooks: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except SchemaError as exc:
        print(f"fluxora-webhooks: {exc}", file=sys.stderr)
        return EXIT_SCHEMA
    except FluxoraError as exc:
        print(f"fluxora-webhooks: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # the layer below, translated in one place: no traceback
        message = _describe_failure(exc)
        if message is None:
            raise
        print(f"fluxora-webhooks: {logs.scrub(message)}", file=sys.stderr)
        return 1


def _describe_failure(exc: BaseException) -> str | None:
    """A one-line message for the failures a user can meet (database or port unavailable)."""
    import psycopg
    import redis

    first_line = (str(exc).strip().splitlines() or [""])[0]
    if isinstance(exc, psycopg.OperationalError):
        return f"cannot reach the database: {first_line or type(exc).__name__}"
    if isinstance(exc, psycopg.Error):
        return f"database error ({type(exc).__name__}): {first_line}"
    if isinstance(exc, redis.RedisError):
        return f"Redis error ({type(exc).__name__}): {first_line}"
    if isinstance(exc, OSError):
        return f"{exc.strerror or type(exc).__name__}" + (
            f": {exc.filename}" if exc.filename else ""
        )
    return None


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
