"""Which PostgreSQL and Redis the tests use."""

from __future__ import annotations

import contextlib
import os
import socket
import uuid
from collections.abc import Iterator
from functools import cache
from pathlib import Path
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
    if not _force_embedded() and _reachable("127.0.0.1", 5432):
        return DEFAULT_PG
    return _embedded_admin_url()


@cache
def redis_url() -> str:
    url = os.environ.get("FLUXORA_TEST_REDIS_URL")
    if url:
        return url
    if not _force_embedded() and _reachable("127.0.0.1", 6379):
        return DEFAULT_REDIS
    return _embedded_redis_url()


def _force_embedded() -> bool:
    """``FLUXORA_TEST_ENGINES=embedded`` runs the suite as on a machine with neither engine."""
    return os.environ.get("FLUXORA_TEST_ENGINES", "").strip().lower() == "embedded"


def with_dbname(url: str, name: str) -> str:
    parts = urlsplit(url)
    if parts.scheme.startswith("postgres"):
        return urlunsplit(parts._replace(path="/" + name))
    # libpq key=value string
    kept = [p for p in url.split() if not p.startswith("dbname=")]
    return " ".join([*kept, f"dbname={name}"])


# A fixed folder: later runs reuse the initialised engines; every xdist worker shares them
# and the last one out stops them.
EMBEDDED_HOME = Path(
    os.environ.get("FLUXORA_TEST_HOME", "") or Path(__file__).resolve().parents[2] / ".fluxora-test"
)


def _embedded_admin_url() -> str:
    from fluxora_webhooks.embedded import embedded_database_url

    return with_dbname(embedded_database_url(EMBEDDED_HOME), "postgres")


def _embedded_redis_url() -> str:
    from fluxora_webhooks.embedded import embedded_redis_url

    return embedded_redis_url(EMBEDDED_HOME)


@contextlib.contextmanager
def copied_database(admin_url: str, template: str, prefix: str) -> Iterator[str]:
    """A database of its own made from ``template`` (named ``prefix`` and a random part):
    its URL, and it is dropped after."""
    import psycopg
    from psycopg import sql

    name = f"{prefix}{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(template)
            )
        )
    try:
        yield with_dbname(admin_url, name)
    finally:
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )
