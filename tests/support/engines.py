"""Which PostgreSQL and Redis the tests use."""

from __future__ import annotations

import os
import socket
from functools import cache
from urllib.parse import urlsplit, urlunsplit

DEFAULT_PG = "postgresql://postgres@127.0.0.1:5432/postgres"
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


@cache
def admin_database_url() -> str:
    """A superuser URL to the maintenance database; tests create their databases there."""
    url = os.environ.get("FLUXORA_TEST_DATABASE_URL")
    if url:
        return url
    if _reachable("127.0.0.1", 5432):
        return DEFAULT_PG
    return _embedded_admin_url()


@cache
def redis_url() -> str:
    url = os.environ.get("FLUXORA_TEST_REDIS_URL")
    if url:
        return url
    if _reachable("127.0.0.1", 6379):
        return DEFAULT_REDIS
    return _embedded_redis_url()


def with_dbname(url: str, name: str) -> str:
    parts = urlsplit(url)
    if parts.scheme.startswith("postgres"):
        return urlunsplit(parts._replace(path="/" + name))
    # libpq key=value string
    kept = [p for p in url.split() if not p.startswith("dbname=")]
    return " ".join([*kept, f"dbname={name}"])


def _embedded_admin_url() -> str:
    raise RuntimeError("no PostgreSQL reachable on 127.0.0.1:5432 and no embedded fallback yet")


def _embedded_redis_url() -> str:
    raise RuntimeError("no Redis reachable on 127.0.0.1:6379 and no embedded fallback yet")
