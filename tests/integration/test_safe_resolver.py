"""The connect-time address policy, through the dispatcher's HTTP client.

Host names resolve through a fake inner resolver that answers whatever each test chooses.
Only loopback addresses are ever connected to: the table of refused ranges is checked at
the resolver, where a broken policy would show as a missing refusal, not as traffic; the
tests that go through a real connection use 127.0.0.0/8, ::1 and ::ffff:127.0.0.1 only.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import pytest
from aiohttp import web
from aiohttp.abc import AbstractResolver, ResolveResult

from fluxora_webhooks.connector import AddressRefused, SafeResolver
from fluxora_webhooks.errors import EndpointError
from fluxora_webhooks.httpclient import HttpClient
from fluxora_webhooks.urlpolicy import check_address
from tests.support.resolvers import answer

pytestmark = pytest.mark.integration

net = ipaddress.ip_network


class ScriptedResolver(AbstractResolver):
    """Answers the n-th lookup with the n-th list of addresses (the last one repeats)."""

    def __init__(self, *answers: Sequence[str]) -> None:
        self.answers = [list(a) for a in answers]
        self.lookups: list[str] = []

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        addresses = self.answers[min(len(self.lookups), len(self.answers) - 1)]
        self.lookups.append(host)
        return answer(host, port, addresses)

    async def close(self) -> None:
        pass


# --- every refused range ----------------------------------------------------------------------

# (an address inside the range, words the refusal reason must contain)
IPV4_REFUSED = [
    ("0.0.0.0", "unspecified"),
    ("0.255.255.255", "unspecified"),
    ("10.0.0.1", "private address (10.0.0.0/8)"),
    ("10.255.255.254", "private address (10.0.0.0/8)"),
    ("100.64.0.1", "CGNAT"),
    ("100.127.255.254", "CGNAT"),
    ("127.0.0.1", "loopback"),
    ("127.255.255.254", "loopback"),
    ("169.254.0.1", "link-local"),
    ("169.254.169.254", "cloud metadata"),
    ("169.254.170.2", "cloud metadata"),
    ("100.100.100.200", "cloud metadata"),
    ("172.16.0.1", "private address (172.16.0.0/12)"),
    ("172.31.255.254", "private address (172.16.0.0/12)"),
    ("192.0.0.8", "IETF protocol assignment"),
    ("192.0.0.192", "cloud metadata"),
    ("192.0.2.1", "documentation"),
    ("192.88.99.1", "6to4 relay"),
    ("192.168.0.1", "private address (192.168.0.0/16)"),
    ("192.168.255.254", "private address (192.168.0.0/16)"),
    ("198.18.0.1", "benchmarking"),
    ("198.19.255.254", "benchmarking"),
    ("198.51.100.1", "documentation"),
    ("203.0.113.1", "documentation"),
    ("224.0.0.1", "multicast"),
    ("239.255.255.250", "multicast"),
    ("240.0.0.1", "reserved"),
    ("254.255.255.254", "reserved"),
    ("255.255.255.255", "broadcast"),
]
IPV6_REFUSED = [
    ("::", "unspecified"),
    ("::1", "loopback"),
    ("100::1", "discard-only"),
    ("2001:2::1", "benchmarking"),
    ("2001:10::1", "IETF protocol assignment"),
    ("2001:db8::1", "documentation"),
    ("3fff::1", "documentation"),
    ("fc00::1", "unique local"),
    ("fd12:3456:789a::1", "unique local"),
    ("fd00:ec2::254", "cloud metadata"),
    ("fd20:ce::254", "cloud metadata"),
    ("fe80::1", "link-local"),
    ("fe80::1%2", "link-local"),
    ("febf:ffff::1", "link-local"),
    ("fec0::1", "site-local"),
    ("ff02::1", "multicast"),
    ("ff05::1:3", "multicast"),
    ("64:ff9b:1::808:808", "local-use NAT64"),
    ("::808:808", "IPv4-compatible"),
    ("4000::1", "reserved"),
    ("5f00::1", "reserved"),
    ("e000::1", "reserved"),
]


def ipv6_forms(v4: str) -> list[tuple[str, str]]:
    """The IPv6 spellings that reach the IPv4 address ``v4``, with the label of each."""
    n = int(ipaddress.IPv4Address(v4))
    teredo_client = ipaddress.IPv6Address(
        (0x20010000 << 96) | (int(ipaddress.IPv4Address("8.8.8.8")) << 64) | (n ^ 0xFFFFFFFF)
    )
    return [
        (f"::ffff:{v4}", "IPv4-mapped"),
        (str(ipaddress.IPv6Address((0xFFFF << 32) | n)), "IPv4-mapped"),
        (str(ipaddress.IPv6Address((0xFFFF << 48) | n)), "IPv4-translated"),
        (f"64:ff9b::{v4}", "NAT64"),
        (str(ipaddress.IPv6Address((0x2002 << 112) | (n << 80) | 1)), "6to4"),
        (str(teredo_client), "Teredo"),
        (f"64:ff9b:1::{v4}", "local-use NAT64"),
    ] + ([(f"::{v4}", "IPv4-compatible")] if n > 1 else [])


TABLE = (
    [(a, why) for a, why in IPV4_REFUSED]
    + [(a, why) for a, why in IPV6_REFUSED]
    + [(form, label) for v4, _ in IPV4_REFUSED for form, label in ipv6_forms(v4)]
)


@pytest.mark.parametrize(("address", "words"), TABLE)
async def test_every_refused_range_is_refused_through_a_host_name(address: str, words: str) -> None:
    assert words in (check_address(address) or "")
    resolver = SafeResolver(False, resolver=ScriptedResolver([address]))
    with pytest.raises(AddressRefused) as caught:
        await resolver.resolve("victim.example", 443, socket.AF_UNSPEC)
    assert caught.value.address == address
    assert "victim.example" in str(caught.value)
    assert words in str(caught.value)


@pytest.mark.parametrize("v4", ["8.8.8.8", "93.184.216.34", "1.1.1.1"])
async def test_the_same_forms_of_a_public_address_pass(v4: str) -> None:
    forms = [v4] + [
        form
        for form, label in ipv6_forms(v4)
        if label not in ("local-use NAT64", "IPv4-compatible")
    ]
    resolver = SafeResolver(False, resolver=ScriptedResolver(forms))
    answers = await resolver.resolve("public.example", 443, socket.AF_UNSPEC)
    assert [a["host"] for a in answers] == forms


# --- through a real connection (loopback only) -------------------------------------------------


@dataclass
class Server:
    port_v4: int
    port_v6: int
    hits: list[tuple[str, str]] = field(default_factory=list)  # (Host header, local address)


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    hits: list[tuple[str, str]] = []

    async def hook(request: web.Request) -> web.Response:
        sockname = request.transport.get_extra_info("sockname") if request.transport else None
        hits.append((request.host, str(sockname[0]) if sockname else "?"))
        response = web.Response(text="ok")
        response.force_close()  # every request opens a new connection: each one is checked
        return response

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", hook)
    runner = web.AppRunner(app)
    await runner.setup()
    v4 = web.TCPSite(runner, "127.0.0.1", 0)
    v6 = web.TCPSite(runner, "::1", 0)
    await v4.start()
    await v6.start()
    ports = {addr[0]: addr[1] for addr in runner.addresses}
    s = Server(port_v4=ports["127.0.0.1"], port_v6=ports["::1"], hits=hits)
    yield s
    await runner.cleanup()


def make_client(
    *,
    allow_loopback: bool,
    resolver: AbstractResolver,
    allowed_networks: Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network] = (),
) -> HttpClient:
    return HttpClient(SafeResolver(allow_loopback, allowed_networks, resolver=resolver))


async def fetch(client: HttpClient, url: str) -> int:
    response = await client.post(url, b"{}", {}, timeout_s=5, max_body=65536)
    return response.status


@pytest.mark.parametrize("address", ["127.0.0.1", "127.9.9.9", "::ffff:127.0.0.1", "::1"])
async def test_a_host_name_resolving_to_loopback_is_refused_before_connecting(
    server: Server, address: str
) -> None:
    port = server.port_v6 if address == "::1" else server.port_v4
    client = make_client(allow_loopback=False, resolver=ScriptedResolver([address]))
    try:
        with pytest.raises(AddressRefused) as caught:
            await fetch(client, f"http://victim.example:{port}/")
    finally:
        await client.close()
    assert isinstance(caught.value, EndpointError)
    assert "loopback" in str(caught.value)
    assert server.hits == []


@pytest.mark.parametrize("host", ["127.0.0.1", "127.9.9.9", "[::ffff:127.0.0.1]", "[::1]"])
async def test_an_ip_literal_url_is_checked_at_the_socket(server: Server, host: str) -> None:
    port = server.port_v6 if host == "[::1]" else server.port_v4
    resolver = ScriptedResolver(["8.8.8.8"])  # must not be consulted for a literal
    client = make_client(allow_loopback=False, resolver=resolver)
    try:
        with pytest.raises(AddressRefused) as caught:
            await fetch(client, f"http://{host}:{port}/")
    finally:
        await client.close()
    assert "loopback" in str(caught.value)
    assert server.hits == []
    assert resolver.lookups == []


async def test_an_explicitly_loopback_consumer_is_reached(server: Server) -> None:
    client = make_client(allow_loopback=True, resolver=ScriptedResolver(["127.0.0.1"]))
    try:
        assert await fetch(client, f"http://localhost:{server.port_v4}/") == 200
        assert await fetch(client, f"http://127.0.0.1:{server.port_v4}/") == 200
        assert await fetch(client, f"http://[::1]:{server.port_v6}/") == 200
    finally:
        await client.close()
    assert [local for _, local in server.hits] == ["127.0.0.1", "127.0.0.1", "::1"]


async def test_only_the_allowed_addresses_of_an_answer_are_connected_to(server: Server) -> None:
    # 127.0.0.2 is refused (loopback, not allowed) and listed first; the server listens only
    # on 127.0.0.1, so had the connector tried 127.0.0.2 the request would still have
    # succeeded: the resolver's answer is what must show the refusal.
    resolver = ScriptedResolver(["127.0.0.2", "127.0.0.1"])
    client = make_client(
        allow_loopback=False, allowed_networks=[net("127.0.0.1/32")], resolver=resolver
    )
    try:
        assert await fetch(client, f"http://mixed.example:{server.port_v4}/") == 200
    finally:
        await client.close()
    assert server.hits == [(f"mixed.example:{server.port_v4}", "127.0.0.1")]
    safe = SafeResolver(
        False, [net("127.0.0.1/32")], resolver=ScriptedResolver(["127.0.0.2", "127.0.0.1"])
    )
    assert [a["host"] for a in await safe.resolve("mixed.example")] == ["127.0.0.1"]


async def test_dns_rebinding_cannot_redirect_a_checked_connection(server: Server) -> None:
    """The first answer is allowed, every later one points somewhere refused.

    A check-then-connect design resolves twice (once to check, once to connect) and would
    connect to the second answer. Here there is one resolution per connection, it is the
    one checked, and it is the one connected to; the later, refused answer is never used
    for a connection.
    """
    resolver = ScriptedResolver(["127.0.0.1"], ["127.0.0.2"])
    client = make_client(
        allow_loopback=False,
        allowed_networks=[net("127.0.0.1/32")],  # stands in for a public address
        resolver=resolver,
    )
    url = f"http://rebind.example:{server.port_v4}/hook"
    try:
        assert await fetch(client, url) == 200
        assert resolver.lookups == ["rebind.example"]  # checked once, connected once
        # A new connection within the DNS cache lifetime reuses the answer that was checked.
        client.close_idle()
        assert await fetch(client, url) == 200
        assert resolver.lookups == ["rebind.example"]
        # Once the cache is gone the host resolves again, to the rebound address: refused.
        client.close_idle()
        client.clear_dns_cache()
        with pytest.raises(AddressRefused) as caught:
            await fetch(client, url)
        assert caught.value.address == "127.0.0.2"
        assert resolver.lookups == ["rebind.example", "rebind.example"]
    finally:
        await client.close()
    # Both requests reached the checked address, with the host name kept for virtual hosts.
    assert server.hits == [(f"rebind.example:{server.port_v4}", "127.0.0.1")] * 2
