"""Endpoint safety: the URL policy, and (at connect time) the address policy."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from .errors import EndpointError

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


def is_loopback_host(host: str) -> bool:
    """True for ``localhost``, 127.0.0.0/8 and ::1 written literally in a URL."""
    host = host.strip("[]").lower().rstrip(".")
    if host in LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def validate_url(url: str) -> None:
    """Apply the URL policy. Raises :class:`EndpointError` (the message names no secret).

    - ``https`` is required; ``http`` only for a loopback host.
    - Credentials in the URL are refused; so is every other scheme.
    """
    try:
        parts = urlsplit(url)
        host = parts.hostname
        _ = parts.port  # raises ValueError on a bad port
    except ValueError:
        raise EndpointError("the URL cannot be parsed") from None
    scheme = parts.scheme.lower()
    if scheme not in ("https", "http"):
        raise EndpointError(f"scheme {scheme or '(none)'!r} is not allowed; use https")
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise EndpointError("URLs with embedded credentials are not allowed")
    if not host:
        raise EndpointError("the URL has no host")
    if scheme == "http" and not is_loopback_host(host):
        raise EndpointError(f"https is required for {host} (http is allowed for loopback only)")


def redacted(url: str) -> str:
    """Scheme and host (and port) only: safe to log."""
    try:
        parts = urlsplit(url)
        return f"{parts.scheme}://{parts.netloc.rsplit('@', 1)[-1]}"
    except ValueError:
        return "(unparseable url)"
