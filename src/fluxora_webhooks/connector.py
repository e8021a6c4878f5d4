"""Endpoint safety, part two: the connector that resolves, checks and pins.

:class:`SafeResolver` drops the addresses the address policy of :mod:`.urlpolicy` refuses
and returns only the checked ones, so aiohttp connects to exactly an address that passed: a
DNS answer that changes between the check and the connection (DNS rebinding) has nothing
to exploit, because there is only one resolution and it is the one that is used. The
connector built by :func:`make_connector` also checks the address of every socket it opens,
which covers URLs whose host is an IP literal (aiohttp does not resolve those).

A refusal at connect time raises :class:`AddressRefused`, which is both an
:class:`~fluxora_webhooks.errors.EndpointError` and an ``OSError``: aiohttp wraps it, like
any connection failure, in an ``aiohttp.ClientConnectorError`` whose ``os_error`` is the
:class:`AddressRefused`.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Sequence

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.connector import AddrInfoType

from .errors import EndpointError
from .urlpolicy import (
    LOOPBACK_NETWORKS,
    IPAddress,
    IPNetwork,
    check_address,
    never_allowed_reason,
    parse_ip,
    shown_host,
)

log = logging.getLogger(__name__)

DEFAULT_RESOLVE_TIMEOUT = 5.0
# Each cached DNS answer was checked before it was cached, so the cache cannot be used to
# bypass the policy; a short lifetime only keeps up with legitimate DNS changes.
DNS_CACHE_TTL_SECONDS = 10
KEEPALIVE_TIMEOUT_SECONDS = 15.0


class AddressRefused(EndpointError, OSError):
    """The address policy refused every address of a host.

    An :class:`EndpointError` for our code and an ``OSError`` for aiohttp, which wraps it in
    ``aiohttp.ClientConnectorError`` (``.os_error`` is this exception). ``host`` is the host
    name, ``address`` the (first) refused address, ``reason`` why it was refused.
    """

    def __init__(self, host: str, address: str, reason: str, *, hint: bool = True) -> None:
        self.host = host
        self.address = address
        self.reason = reason
        message = f"{shown_host(host)}: refused to connect to {address}, {reason}"
        if hint:
            message += "; add it to WEBHOOK_ALLOWED_NETWORKS if this consumer is intended"
        super().__init__(errno.EACCES, message)

    def __str__(self) -> str:
        return str(self.strerror)


_NOT_LOOPBACK = "not a loopback address (plain http is allowed to loopback only; use https)"


def _refuse(host: str, address: str, reason: str) -> AddressRefused:
    parsed = parse_ip(address)
    fixed = parsed is None or never_allowed_reason(parsed) is not None or reason == _NOT_LOOPBACK
    return AddressRefused(host, address, reason, hint=not fixed)


class SafeResolver(AbstractResolver):
    """A resolver that returns only the addresses the address policy allows.

    ``resolver`` does the resolving (default: aiohttp's ``ThreadedResolver``, i.e. the
    system's ``getaddrinfo``); each lookup is bounded by ``timeout`` seconds. When every
    address of a host is refused, :class:`AddressRefused` is raised; aiohttp reports it as
    ``aiohttp.ClientConnectorDNSError``. A timeout raises ``OSError(ETIMEDOUT)``.
    """

    def __init__(
        self,
        allow_loopback: bool,
        allowed_networks: Sequence[IPNetwork] = (),
        resolver: AbstractResolver | None = None,
        timeout: float = DEFAULT_RESOLVE_TIMEOUT,
        *,
        require_loopback: bool = False,
    ) -> None:
        self.allow_loopback = allow_loopback or require_loopback
        self.require_loopback = require_loopback
        self.allowed_networks = tuple(allowed_networks)
        self._resolver = resolver
        self._owns_resolver = resolver is None
        self._timeout = timeout

    def check(self, ip: str | IPAddress) -> str | None:
        """The refusal reason for ``ip`` under this resolver's policy, or None.

        With ``require_loopback`` (a plain-http URL) only loopback addresses pass: http is
        allowed because the host is loopback, so a name that resolves elsewhere must not
        get an unencrypted request, whatever ``WEBHOOK_ALLOWED_NETWORKS`` allows.
        """
        if self.require_loopback:
            address = parse_ip(ip)
            if address is None:
                return "not an IP address"
            if not any(address in net for net in LOOPBACK_NETWORKS):
                return _NOT_LOOPBACK
        return check_address(
            ip, allow_loopback=self.allow_loopback, allowed_networks=self.allowed_networks
        )

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        if self._resolver is None:
            self._resolver = aiohttp.ThreadedResolver()
        try:
            async with asyncio.timeout(self._timeout):
                answers = await self._resolver.resolve(host, port, family)
        except TimeoutError:
            raise OSError(
                errno.ETIMEDOUT, f"resolving {shown_host(host)} timed out after {self._timeout}s"
            ) from None
        allowed: list[ResolveResult] = []
        refused: list[tuple[str, str]] = []
        for answer in answers:
            reason = self.check(answer["host"])
            if reason is None:
                allowed.append(answer)
            else:
                refused.append((answer["host"], reason))
        if not allowed:
            if refused:
                raise _refuse(host, *refused[0])
            raise OSError(errno.EHOSTUNREACH, f"{shown_host(host)} resolved to no address")
        if refused:
            log.warning(
                "%s: skipped %d refused address(es), e.g. %s (%s)",
                shown_host(host),
                len(refused),
                *refused[0],
            )
        return allowed

    async def close(self) -> None:
        if self._owns_resolver and self._resolver is not None:
            resolver, self._resolver = self._resolver, None
            await resolver.close()


class SafeConnector(aiohttp.TCPConnector):
    """A ``TCPConnector`` that resolves through a :class:`SafeResolver` and checks the
    address of every socket it opens; closing it closes the resolver. Build it with
    :func:`make_connector`."""

    def __init__(self, *, safe_resolver: SafeResolver, limit: int) -> None:
        self.safe_resolver = safe_resolver
        super().__init__(
            resolver=safe_resolver,
            limit=limit,
            use_dns_cache=True,
            ttl_dns_cache=DNS_CACHE_TTL_SECONDS,
            keepalive_timeout=KEEPALIVE_TIMEOUT_SECONDS,
            socket_factory=self._open_checked_socket,
        )

    def _open_checked_socket(self, addr_info: AddrInfoType) -> socket.socket:
        # The last word: the exact address this socket will connect to. It covers IP-literal
        # URLs, which aiohttp never passes to the resolver.
        family, type_, proto, _, sockaddr = addr_info
        address = str(sockaddr[0])
        reason = self.safe_resolver.check(address)
        if reason is not None:
            raise _refuse(address, address, reason)
        return socket.socket(family=family, type=type_, proto=proto)

    async def close(self, *, abort_ssl: bool = False) -> None:
        await super().close(abort_ssl=abort_ssl)
        await self.safe_resolver.close()


def make_connector(
    *,
    allow_loopback: bool,
    allowed_networks: Sequence[IPNetwork] = (),
    limit: int = 100,
    resolver: AbstractResolver | None = None,
    resolve_timeout: float = DEFAULT_RESOLVE_TIMEOUT,
    require_loopback: bool = False,
) -> aiohttp.TCPConnector:
    """The dispatcher's connector: keep-alive, at most ``limit`` connections, and every
    connection made to an address the policy allows (resolved, checked and pinned).

    ``allow_loopback`` and ``require_loopback`` come from
    :func:`~fluxora_webhooks.urlpolicy.loopback_rule` of ``WEBHOOK_URL`` (require: a plain
    http URL, whose every connection must go to a loopback address);
    ``allowed_networks`` is ``Settings.allowed_networks``. ``resolver`` replaces the system
    resolver (tests; or ``aiohttp.AsyncResolver``). Must be called with a running loop.
    """
    safe = SafeResolver(
        allow_loopback,
        allowed_networks,
        resolver=resolver,
        timeout=resolve_timeout,
        require_loopback=require_loopback,
    )
    return SafeConnector(safe_resolver=safe, limit=limit)
