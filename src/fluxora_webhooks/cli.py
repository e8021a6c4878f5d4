"""The ``fluxora-webhooks`` command: builds the parser from the command modules, runs one,
and translates errors into one-line messages and exit codes. Nothing more.

Exit codes: 0 done, 1 failed (the message says why), 2 bad configuration or usage (the
message names the variable or option), 3 the database schema is missing, older or newer
than this version (the message says what to run), 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any, NoReturn

from . import logs
from ._version import __version__
from .commands import COMMANDS
from .commands.common import EXIT_CONFIG, EXIT_FAILED, EXIT_SCHEMA
from .errors import ConfigError, FluxoraError, SchemaError
from .settings import secret_file_hint, with_secret_files


def _modules() -> list[ModuleType]:
    return [importlib.import_module(f".commands.{name}", __package__) for name in COMMANDS]


class _Parser(argparse.ArgumentParser):
    """A usage error is a record like any other line with ``LOG_FORMAT=json`` (a service's
    command line is written in its deployment, where a pipeline reads JSON). An option is
    taken only as spelled out: with argparse's prefixes, `dlq purge --a --y` purged every
    dead letter. The commands' own parsers are of this class too (argparse makes a
    subcommand's parser of its parent's class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        if logs.json_configured():
            logging.getLogger("fluxora_webhooks.cli").critical(
                "error: %s (see `%s --help`)", message, self.prog
            )
            self.exit(EXIT_CONFIG)
        super().error(message)


def build_parser(modules: Sequence[ModuleType] | None = None) -> argparse.ArgumentParser:
    parser = _Parser(
        prog="fluxora-webhooks",
        description="Reliable webhooks from a PostgreSQL transactional outbox.",
    )
    parser.add_argument("--version", action="version", version=f"fluxora-webhooks {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in modules or _modules():
        description = getattr(module, "DESCRIPTION", None)
        p = sub.add_parser(
            module.NAME,
            help=module.HELP,
            description=description or module.HELP,
            formatter_class=argparse.RawDescriptionHelpFormatter,
            add_help=not getattr(module, "PASSTHROUGH", False),
        )
        module.configure(p)
        p.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] in (["run"], ["api"]):
        # The process's own command: a stop signal during start-up is kept for it.
        from .host import hold_early_stops

        hold_early_stops()
    argv = list(sys.argv[1:] if argv is None else argv)
    _not_a_metrics_worker()
    env = dict(os.environ)
    logs.configure(env.get("LOG_FORMAT", "text").strip().lower() or "text")
    modules = _modules()
    try:
        env = with_secret_files(env)
        passthrough = {m.NAME: m for m in modules if getattr(m, "PASSTHROUGH", False)}
        if argv and argv[0] in passthrough:
            # Its arguments belong to another program (argparse would take "--help" or a
            # leading "-" for itself).
            return int(passthrough[argv[0]].run(argparse.Namespace(rest=argv[1:]), env))
        parser = build_parser(modules)
        args = parser.parse_args(join_dash_values(argv, known_options(parser)))
        return int(args.run(args, env))
    except ConfigError as exc:
        # A command-line option is no configuration: "error: --yes: ...".
        kind = "error" if exc.variable.startswith("-") else "configuration error"
        _fatal(f"{kind}: {exc}{secret_file_hint(exc.variable, os.environ)}", env)
        return EXIT_CONFIG
    except SchemaError as exc:
        _fatal(str(exc), env)
        return EXIT_SCHEMA
    except FluxoraError as exc:
        _fatal(str(exc), env)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`... | head`): what it took was written; nothing to report.
        # Standard output goes nowhere from now on, so the exit's own flush is quiet too.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as exc:  # the layer below, translated in one place: no traceback
        message = _describe_failure(exc, env)
        if message is None:
            raise
        _fatal(logs.escape_controls(logs.scrub(message)), env)
        return EXIT_FAILED


# prometheus-client's multiprocess mode is chosen by these variables when it is first
# imported (the command modules import it): inherited from an environment made for a
# gunicorn app, they would make `run`'s one process write its values to files nobody
# merges and take itself for a supervisor's worker (its own series gone). The command's
# process is never such a worker: the supervisor starts its workers as
# `python -m fluxora_webhooks.worker`, with a folder of its own (and FLUXORA_WORKER).
_INHERITED_METRICS_VARIABLES = ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir")


def _not_a_metrics_worker() -> None:
    """Forget an inherited multiprocess folder (and worker mark) before prometheus-client is
    imported; an embedding application keeps its own (this is the command line only)."""
    if "prometheus_client" in sys.modules:
        return  # imported already (a test calling main in-process): its mode is chosen
    for name in (*_INHERITED_METRICS_VARIABLES, "FLUXORA_WORKER"):
        os.environ.pop(name, None)


# Options whose value may start with "-": a signing secret (endpoints add and rotate-secret
# --secret); secrets.token_urlsafe starts one in 64 so.
DASH_VALUE_OPTIONS = frozenset({"--secret"})


def known_options(parser: argparse.ArgumentParser) -> frozenset[str]:
    """Every option string of the parser and of its subcommands, at any depth."""
    found = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= known_options(sub)
    return frozenset(found)


def join_dash_values(argv: Sequence[str], known: frozenset[str]) -> list[str]:
    """``--secret -x...`` as ``--secret=-x...``: argparse takes any word that starts with
    "-" for an option, and fails with "expected one argument". Only for
    :data:`DASH_VALUE_OPTIONS`, and only when the next word is no option of the command
    (nor an abbreviation argparse would take for one): ``--secret --url U`` still fails."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":  # the rest are arguments, as they are
            return [*out, *argv[i:]]
        if word in DASH_VALUE_OPTIONS and i + 1 < len(argv) and _dash_value(argv[i + 1], known):
            out.append(f"{word}={argv[i + 1]}")
            i += 2
            continue
        out.append(word)
        i += 1
    return out


def _dash_value(word: str, known: frozenset[str]) -> bool:
    if not word.startswith("-") or word == "--":
        return False  # argparse takes it as the value already, or it ends the options
    name = word.partition("=")[0]
    if name in known:
        return False
    return not (name.startswith("--") and any(option.startswith(name) for option in known))


def _fatal(message: str, env: Mapping[str, str]) -> None:
    """Why the command stops, on stderr: a line of text, or with ``LOG_FORMAT=json`` a
    log record like every other line a pipeline reading JSON gets."""
    if env.get("LOG_FORMAT", "").strip().lower() == "json":
        logging.getLogger("fluxora_webhooks.cli").critical("%s", message)
        return
    print(f"fluxora-webhooks: {message}", file=sys.stderr)


def _describe_failure(exc: BaseException, env: Mapping[str, str]) -> str | None:
    """A one-line message for the failures a user can meet (database or port unavailable),
    naming the variable that chose the engine when one did (the demo's embedded engines
    have none)."""
    import psycopg
    import redis

    from .migrations import READ_ONLY_HINT, each_host_failed

    def named(variable: str) -> str:
        return f" ({variable})" if env.get(variable, "").strip() else ""

    first_line = (str(exc).strip().splitlines() or [""])[0]
    if isinstance(exc, psycopg.errors.ReadOnlySqlTransaction):
        return f"the database is read-only{named('DATABASE_URL')}: {READ_ONLY_HINT}"
    state = getattr(exc, "sqlstate", None) or ""
    if isinstance(exc, psycopg.Error) and state.startswith("53") and state != "53300":
        # Reached, and out of something (shared memory for locks, disk): not unreachable
        # (53300 is too many connections: it is, for now).
        return f"the database{named('DATABASE_URL')} ran out of resources: {first_line}"
    if isinstance(exc, psycopg.errors.QueryCanceled | psycopg.errors.LockNotAvailable):
        # Reached, and a statement stopped: not unreachable (both are OperationalErrors).
        return (
            f"the database{named('DATABASE_URL')} cancelled a statement of this command:"
            f" {first_line} (a statement_timeout or lock_timeout set for the role or the"
            " database, ALTER ROLE|DATABASE ... SET or PGOPTIONS, shorter than the command"
            " needs; or an operator's pg_cancel_backend)"
        )
    if isinstance(exc, psycopg.OperationalError) and not isinstance(
        exc,
        psycopg.errors.ProgramLimitExceeded,  # a statement refused for what it holds
    ):
        hosts = each_host_failed(str(exc))
        why = hosts or first_line or type(exc).__name__
        return f"cannot reach the database{named('DATABASE_URL')}: {why}"
    if isinstance(exc, psycopg.Error):
        return f"database error ({type(exc).__name__}): {first_line}"
    if isinstance(exc, redis.RedisError):
        at = " at REDIS_URL" if named("REDIS_URL") else ""
        return f"Redis error{at} ({type(exc).__name__}): {first_line}"
    if isinstance(exc, OSError):
        return f"{exc.strerror or type(exc).__name__}" + (
            f": {exc.filename}" if exc.filename else ""
        )
    return None


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
