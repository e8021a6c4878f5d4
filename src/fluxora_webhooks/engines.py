"""Where the database and Redis are: the configured URLs, or the embedded engines."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("fluxora_webhooks")


@dataclass(frozen=True)
class Engines:
    database_url: str
    redis_url: str
    embedded: tuple[str, ...]  # which engines are embedded ("postgres", "redis")


def resolve(database_url: str | None, redis_url: str | None, home: Path) -> Engines:
    """Use the configured URLs; start (or reuse) the embedded engines for the others."""
    embedded: list[str] = []
    if database_url is None:
        from .embedded import embedded_database_url

        database_url = embedded_database_url(home)
        embedded.append("PostgreSQL")
    if redis_url is None:
        from .embedded import embedded_redis_url

        redis_url = embedded_redis_url(home)
        embedded.append("Redis")
    if embedded:
        log.warning(
            "running on the embedded %s in %s (set %s to use your own)",
            " and ".join(embedded),
            home,
            " and ".join(
                v
                for v, e in (("DATABASE_URL", "PostgreSQL"), ("REDIS_URL", "Redis"))
                if e in embedded
            ),
        )
    return Engines(database_url, redis_url, tuple(embedded))
