"""A name resolved to given addresses, in the given order (as a dual-stack name is): what
the dispatcher's address policy and connection pinning are tested against."""

from __future__ import annotations

import socket
from collections.abc import Sequence

from aiohttp.abc import AbstractResolver, ResolveResult


def answer(host: str, port: int, addresses: Sequence[str]) -> list[ResolveResult]:
    """What a resolver returns for ``host``: each address, in the order given."""
    return [
        ResolveResult(
            hostname=host,
            host=a,
            port=port,
            family=socket.AF_INET6 if ":" in a else socket.AF_INET,
            proto=socket.IPPROTO_TCP,
            flags=socket.AI_NUMERICHOST,
        )
        for a in addresses
    ]


class FixedResolver(AbstractResolver):
    def __init__(self, *addresses: str) -> None:
        self.addresses = addresses

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        return answer(host, port, self.addresses)

    async def close(self) -> None:
        return None
