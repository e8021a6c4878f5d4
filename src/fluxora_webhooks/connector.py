"""Endpoint safety, part two: the resolver that checks, so the client can pin.

:class:`SafeResolver` drops the addresses the address policy of :mod:`.urlpolicy` refuses
and returns only the checked ones, so the client (:mod:`.httpclient`) connects to exactly
an address that passed: a DNS answer that changes between the check and the connection
(DNS rebinding) has nothing to exploit, because there is only one resolution and it is the
one that is used. The client also checks each address again just before connecting to it,
which covers URLs whose host is an IP literal (never resolved).

A refusal raises :class:`AddressRefused`, which is both an
:class:`~fluxora_webhooks.errors.EndpointError` (a permanent failure: the endpoint is not
allowed) and an ``OSError``.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Sequence

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult

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


class AddressRefused(EndpointError, OSError):
    """The address policy refused every address of a host.

    An :class:`EndpointError` (a permanent failure) that is also an ``OSError`` (a
    connection that could not be made). ``host`` is the host name, ``address`` the (first)
    refused address, ``reason`` why it was refused.
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


def refuse_address(host: str, address: str, reason: str) -> AddressRefused:
    """The refusal of ``address`` (``host``'s), with a hint at WEBHOOK_ALLOWED_NETWORKS where
    the operator may allow it."""
    return _refuse(host, address, reason)


def _refuse(host: str, address: str, reason: str) -> AddressRefused:
    parsed = parse_ip(address)
    fixed = parsed is None or never_allowed_reason(parsed) is not None or reason == _NOT_LOOPBACK
    return AddressRefused(host, address, reason, hint=not fixed)


class SafeResolver(AbstractResolver):
    """A resolver that returns only the addresses the address policy allows.

    ``resolver`` does the resolving (default: aiohttp's ``ThreadedResolver``, i.e. the
    system's ``getaddrinfo``); each lookup is bounded by ``timeout`` seconds. When every
    address of a host is refused, :class:`AddressRefused` is raised; a timeout raises
    ``OSError(ETIMEDOUT)``.
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
        self.allow_loopback = allow_loopback
        self.require_loopback = require_loopback
        self.allowed_networks = tuple(allowed_networks)
        self._resolver = resolver
        self._owns_resolver = resolver is None
        self._timeout = timeout

    def check(self, ip: str | IPAddress) -> str | None:
        """The refusal reason for ``ip`` under this resolver's policy, or None.

        With ``require_loopback`` (a plain-http URL) only loopback addresses pass: http is
        allowed because the host is loopback, so a name that resolves elsewhere must not
        get an unencrypted request, whatever ``WEBHOOK_ALLOWED_NETWORKS`` allows. It does
        not allow loopback by itself: a registered endpoint's plain-http loopback URL is
        reached only while ``allow_loopback`` or ``allowed_networks`` allows its address
        (the policy in force when it is sent, not the one it was registered under).
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
