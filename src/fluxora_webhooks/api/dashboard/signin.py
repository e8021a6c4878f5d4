"""The sign-in form's checks against a login CSRF (another site signing a browser into an
account of its own).

A sign-in post is refused when its ``Sec-Fetch-Site`` says ``cross-site`` or
``same-site``, or, without that header, when its ``Origin`` is an origin other than the
dashboard's own (the scheme and ``Host`` the server sees: ``X-Forwarded-Proto`` from a
trusted proxy, as uvicorn takes it). See :func:`cross_site`.

The form's value is issued by the server: ``<random>.<issue time>.<HMAC-SHA256>``, the MAC
keyed with ``webhook_api_login_key`` (made by migration 0017, read once per process and
shared by every API process of the database), valid for :data:`VALUE_TTL_S` and in the
form's cookie too. A sign-in uses it up: its sha256 is recorded in
``webhook_api_login_used`` until it would have expired, and it is refused after that.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from typing import Any
from urllib.parse import urlsplit

import psycopg
from fastapi import Request

from ...queries import query
from ..deps import api_state

VALUE_TTL_S = 3600
# A value issued this far in the future (another process's clock ahead) is still taken.
CLOCK_SKEW_S = 300
_MAX_VALUE = 200
_DEFAULT_PORTS = {"http": 80, "https": 443}


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _mac(key: bytes, body: str) -> str:
    return _b64(hmac.new(key, b"fluxora-webhooks sign-in\x00" + body.encode(), "sha256").digest())


def make_value(key: bytes, issued_at: int) -> str:
    """A new form value, issued at ``issued_at`` (Unix seconds)."""
    body = f"{secrets.token_urlsafe(24)}.{issued_at}"
    return f"{body}.{_mac(key, body)}"


def value_issued_at(key: bytes, value: str) -> int | None:
    """The issue time of a value this key signed, else None."""
    if len(value) > _MAX_VALUE or value.count(".") != 2:
        return None
    body, _, mac = value.rpartition(".")
    if not hmac.compare_digest(mac.encode(), _mac(key, body).encode()):
        return None
    issued = body.rpartition(".")[2]
    return int(issued) if issued.isascii() and issued.isdigit() else None


def valid_now(issued_at: int, now: float) -> bool:
    return now - VALUE_TTL_S <= issued_at <= now + CLOCK_SKEW_S


async def login_key(request: Request) -> bytes:
    """The database's sign-in key, read once per app."""
    key: bytes | None = getattr(request.app.state, "fluxora_login_key", None)
    if key is None:
        async with api_state(request).connection() as conn:
            key = await _read_key(conn)
        request.app.state.fluxora_login_key = key
    return key


async def _read_key(conn: psycopg.AsyncConnection[Any]) -> bytes:
    cur = await conn.execute(query("login_key"))
    row = await cur.fetchone()
    if row is None:
        raise RuntimeError("webhook_api_login_key has no key: run `fluxora-webhooks migrate`")
    return bytes(row[0])


async def use_value(conn: psycopg.AsyncConnection[Any], value: str, issued_at: int) -> bool:
    """Records the value as used; False when it already was."""
    cur = await conn.execute(
        query("login_value_use"),
        {
            "value_hash": hashlib.sha256(value.encode()).hexdigest(),
            "expires_at": issued_at + VALUE_TTL_S + CLOCK_SKEW_S,
        },
    )
    return await cur.fetchone() is not None


def _origin(scheme: str, netloc: str) -> tuple[str, str, int | None] | None:
    try:
        parts = urlsplit(f"{scheme}://{netloc}")
        port = parts.port or _DEFAULT_PORTS.get(scheme)
    except ValueError:
        return None
    return scheme.lower(), (parts.hostname or "").lower(), port


def cross_site(request: Request) -> bool:
    """Whether the post came from another site or origin. ``Sec-Fetch-Site`` first, where
    the browser sends it (https, and localhost): ``cross-site`` or ``same-site`` is
    refused, ``same-origin`` taken, whatever the ``Origin`` (the pages' ``Referrer-Policy:
    no-referrer`` makes it ``null``; behind a proxy that rewrites ``Host`` it would not be
    the origin the server sees anyway). Without it (plain http to another host than
    localhost: a browser sends no ``Sec-Fetch-*`` there), an ``Origin`` that is an origin
    must be the dashboard's own, and ``null`` or none is taken: the server-issued,
    one-time value is the check then."""
    fetch_site = request.headers.get("sec-fetch-site", "").strip().lower()
    if fetch_site in ("cross-site", "same-site"):
        return True
    if fetch_site in ("same-origin", "none"):
        return False
    origin = request.headers.get("origin")
    if origin is None or origin.strip() == "null":
        return False
    given = urlsplit(origin.strip())
    if not given.netloc or "@" in given.netloc or given.path or given.query or given.fragment:
        return True  # not an origin
    own = _origin(request.url.scheme, request.url.netloc)
    theirs = _origin(given.scheme, given.netloc)
    return own is None or theirs is None or own != theirs
