"""API tokens and dashboard sessions (SPEC 15): the admin layer behind ``fluxora-webhooks
tokens`` and the API's authentication (``sql/tokens.sql``).

A token is ``fxa_`` + 32 random bytes (URL-safe base64), printed once at creation; only its
sha256 is stored. A request's token is found by its hash and compared again with
:func:`hmac.compare_digest`, so the comparison takes the same time whatever it matches.

Scope: a token is an admin's (``tenant`` None: every tenant) or one tenant's (``''`` is the
default tenant), and read-only or not. A dashboard sign-in opens a session: a random id the
browser keeps in a cookie, stored hashed with its CSRF token; it ends at its expiry, at
sign-out, or when its token is revoked.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row

from . import logs
from .endpoints import check_tenant
from .errors import ConfigError, ConflictError, NotFoundError
from .queries import query

TOKEN_PREFIX = "fxa_"
TOKEN_BYTES = 32
MAX_TOKEN_LENGTH = 256
SESSION_TTL_S = 12 * 3600
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@:-]{0,63}", re.ASCII)


@dataclass(frozen=True)
class Token:
    """A stored token as ``tokens list`` shows it: never the token or its hash."""

    name: str
    tenant: str | None
    read_only: bool
    created_at: datetime | None = None
    last_used_at: datetime | None = None
    revoked_at: datetime | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "tenant": self.tenant,
            "scope": "admin" if self.tenant is None else "tenant",
            "read_only": self.read_only,
            "created_at": _iso(self.created_at),
            "last_used_at": _iso(self.last_used_at),
            "revoked_at": _iso(self.revoked_at),
        }

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Token:
        return cls(
            name=row["name"],
            tenant=row["tenant"],
            read_only=row["read_only"],
            created_at=row["created_at"],
            last_used_at=row["last_used_at"],
            revoked_at=row["revoked_at"],
        )


@dataclass(frozen=True)
class Principal:
    """Who a request acts for: the token's name and its scope."""

    token_id: int
    name: str
    tenant: str | None  # None: an admin, every tenant
    read_only: bool

    @property
    def admin(self) -> bool:
        return self.tenant is None


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(TOKEN_BYTES)


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(
            "--name", "must be 1-64 letters, digits and ._@:- (a letter or digit first)"
        )
    return name


async def create(
    conn: psycopg.AsyncConnection[Any],
    *,
    name: str,
    tenant: str | None = None,
    read_only: bool = False,
) -> tuple[Token, str]:
    """Store a new token; returns it and the token text, shown this once."""
    check_name(name)
    if tenant is not None:
        check_tenant(tenant, "--tenant")
    text = new_token()
    cur = conn.cursor(row_factory=dict_row)
    await cur.execute(
        query("token_insert"),
        {"name": name, "hash": digest(text), "tenant": tenant, "read_only": read_only},
    )
    row = await cur.fetchone()
    if row is None:
        raise ConflictError(f"a token named {name!r} exists already (revoked names stay taken)")
    logs.add_sensitive(text)
    return Token.from_row(row), text


async def list_tokens(conn: psycopg.AsyncConnection[Any]) -> list[Token]:
    cur = conn.cursor(row_factory=dict_row)
    await cur.execute(query("token_list"))
    return [Token.from_row(r) for r in await cur.fetchall()]


async def revoke(conn: psycopg.AsyncConnection[Any], name: str) -> Token:
    """Revoke the token (and end its dashboard sessions); a revoked token answers 401."""
    async with conn.transaction():
        cur = conn.cursor(row_factory=dict_row)
        await cur.execute(query("token_revoke"), {"name": name})
        row = await cur.fetchone()
        if row is None:
            found = await (await conn.execute(query("token_exists"), {"name": name})).fetchone()
            if found is None:
                raise NotFoundError(f"no token named {name!r}")
            raise ConflictError(f"the token {name!r} is revoked already")
        await conn.execute(query("session_delete_for_token"), {"token_id": row["id"]})
    return Token.from_row(row)


# How long an API whose role may not record a token's last use stops trying (per database
# and role).
TOUCH_REFUSED_S = 600.0
_touch_refused_until: dict[tuple[str, int, str, str], float] = {}


async def authenticate(conn: psycopg.AsyncConnection[Any], text: str) -> Principal | None:
    """The live token ``text`` is, or None."""
    if not text or len(text) > MAX_TOKEN_LENGTH:
        return None
    wanted = digest(text)
    cur = conn.cursor(row_factory=dict_row)
    await cur.execute(query("token_lookup"), {"hash": wanted})
    row = await cur.fetchone()
    if row is None or not hmac.compare_digest(row["token_hash"], wanted):
        return None
    who = (conn.info.host, conn.info.port, conn.info.dbname, conn.info.user)
    if row["stale"] and time.monotonic() >= _touch_refused_until.get(who, 0.0):
        try:
            async with conn.transaction():
                await conn.execute(query("token_touch"), {"id": row["id"]})
        except psycopg.errors.ReadOnlySqlTransaction:
            # A read-only database (a standby, a server whose disk is full) still answers
            # reads; its last use is recorded once the database takes writes again.
            pass
        except psycopg.errors.InsufficientPrivilege:
            # An API whose role may only read (docs/operations.md, "Roles and
            # privileges"): no last use, and not asked again on every request.
            _touch_refused_until[who] = time.monotonic() + TOUCH_REFUSED_S
    return Principal(row["id"], row["name"], row["tenant"], row["read_only"])


async def open_session(
    conn: psycopg.AsyncConnection[Any], principal: Principal, ttl_s: int = SESSION_TTL_S
) -> tuple[str, str]:
    """A new dashboard session for ``principal``: (session id for the cookie, CSRF token)."""
    session_id, csrf = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    await conn.execute(
        query("session_insert"),
        {
            "id_hash": digest(session_id),
            "token_id": principal.token_id,
            "csrf": csrf,
            "ttl_s": ttl_s,
        },
    )
    return session_id, csrf


async def find_session(
    conn: psycopg.AsyncConnection[Any], session_id: str
) -> tuple[Principal, str] | None:
    """The session's principal and CSRF token, or None (unknown, expired, token revoked)."""
    if not session_id or len(session_id) > MAX_TOKEN_LENGTH:
        return None
    cur = conn.cursor(row_factory=dict_row)
    await cur.execute(query("session_lookup"), {"id_hash": digest(session_id)})
    row = await cur.fetchone()
    if row is None:
        return None
    return Principal(row["id"], row["name"], row["tenant"], row["read_only"]), row["csrf"]


async def close_session(conn: psycopg.AsyncConnection[Any], session_id: str) -> None:
    await conn.execute(query("session_delete"), {"id_hash": digest(session_id)})
