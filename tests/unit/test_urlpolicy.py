"""The URL policy and the address policy (no network: resolvers here are fakes)."""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import socket

import pytest
import yarl
from aiohttp.abc import AbstractResolver, ResolveResult

from fluxora_webhooks.connector import AddressRefused, SafeResolver
from fluxora_webhooks.dispatcher import make_client
from fluxora_webhooks.errors import EndpointError, FluxoraError
from fluxora_webhooks.httpclient import DNS_CACHE_S
from fluxora_webhooks.settings import Settings
from fluxora_webhooks.urlpolicy import (
    check_address,
    check_url_address,
    is_loopback_host,
    normalise_host,
    redacted,
    validate_url,
)
from tests.support.resolvers import answer

net = ipaddress.ip_network


class FakeResolver(AbstractResolver):
    """Answers every lookup with the addresses it was given; counts lookups."""

    def __init__(self, *addresses: str, delay: float = 0.0) -> None:
        self.addresses = addresses
        self.delay = delay
        self.lookups: list[str] = []
        self.closed = False

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        self.lookups.append(host)
        if self.delay:
            await asyncio.sleep(self.delay)
        return answer(host, port, self.addresses)

    async def close(self) -> None:
        self.closed = True


# --- URL policy -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "https://hooks.example.com/in?token=abc",
        "https://hooks.example.com:8443/",
        "https://HOOKS.Example.COM./path",
        "https://93.184.216.34/",
        "https://[2606:4700::1111]/",
        "https://b\u00fccher.example/",
        "https://xn--bcher-kva.example/",
        "https://i\u2764.ws/",  # IDNA 2003 only (emoji): the HTTP client accepts it too
        "https://my_service.internal.example/",
        "http://localhost:8080/hook",
        "http://LOCALHOST/",
        "http://127.0.0.1:9000/",
        "http://127.9.8.7/",
        "http://[::1]:9000/",
        "http://\uff4c\uff4f\uff43\uff41\uff4c\uff48\uff4f\uff53\uff54/",  # fullwidth "localhost"
    ],
)
def test_accepted_urls(url: str) -> None:
    validate_url(url)


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("http://hooks.example.com/", "https is required for hooks.example.com"),
        ("http://10.0.0.1/", "https is required"),
        ("http://[::ffff:127.0.0.1]/", "https is required"),
        ("http://localhost.evil.com/", "https is required"),
        ("ftp://hooks.example.com/", "scheme 'ftp' is not allowed"),
        ("file:///etc/passwd", "scheme 'file' is not allowed"),
        ("hooks.example.com/path", "is not allowed"),
        ("https://user:pw@hooks.example.com/", "credentials"),
        ("https://user@hooks.example.com/", "credentials"),
        ("https://:pw@hooks.example.com/", "credentials"),
        ("https:///path", "no host"),
        ("https://hooks.example.com:99999/", "cannot be parsed"),
        ("https://hooks.example.com:abc/", "cannot be parsed"),
        ("https://[::1/", "cannot be parsed"),
        ("https://xn--zz.example/", "not valid punycode"),
        ("https://e\u200bvil.example/", "invisible character"),
        ("https://exa mple.com/", "whitespace or a control character"),
        ("https://-bad.example.com/", "not a valid host name"),
        ("https://" + "a" * 64 + ".com/", "not a valid host name"),
        ("https://" + ".".join(["a" * 60] * 5) + "/", "not a valid host name"),
        ("https://a..b.com/", "not a valid host name"),
        ("https://a%2eb.com/", "not a valid host name"),
        ("https://127.1/", "non-standard IPv4 form"),
        ("https://2130706433/", "non-standard IPv4 form"),
        ("https://0x7f.0.0.1/", "non-standard IPv4 form"),
        ("https://\u2460\u2461\u2462.example/", ""),  # circled digits: IDNA maps them to 123
    ],
)
def test_refused_urls(url: str, fragment: str) -> None:
    if fragment == "":
        validate_url(url)  # documented: compatibility mapping is normalisation, not an error
        return
    with pytest.raises(EndpointError) as caught:
        validate_url(url)
    assert fragment in str(caught.value)


def test_refusal_messages_never_contain_the_path_query_or_credentials() -> None:
    secrets = ("token=s3cr3t", "pw-s3cr3t")
    for url in (
        "http://hooks.example.com/in?token=s3cr3t",
        "https://me:pw-s3cr3t@hooks.example.com/in?token=s3cr3t",
        "ftp://hooks.example.com/in?token=s3cr3t",
        "https://xn--zz.example/in?token=s3cr3t",
    ):
        with pytest.raises(EndpointError) as caught:
            validate_url(url)
        assert not any(s in str(caught.value) for s in secrets)


def test_a_huge_host_is_shortened_in_messages() -> None:
    with pytest.raises(EndpointError) as caught:
        validate_url("https://" + "a" * 10_000 + ".com/")
    assert len(str(caught.value)) < 200


class _DisagreeingURL:
    """Stands in for yarl.URL when it reads a URL differently from the standard library."""

    def __init__(self, url: str) -> None:
        self.raw_host = "elsewhere.example"
        self.host = self.raw_host
        self.port = 443


def _unparseable_url(url: str) -> None:
    raise ValueError("cannot parse")


def test_a_url_the_http_client_reads_differently_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(yarl, "URL", _DisagreeingURL)
    with pytest.raises(EndpointError, match="ambiguous"):
        validate_url("https://hooks.example.com/")
    monkeypatch.setattr(yarl, "URL", _unparseable_url)
    with pytest.raises(EndpointError, match="cannot be parsed by the HTTP client"):
        validate_url("https://hooks.example.com/")


def test_validate_url_refuses_non_strings() -> None:
    with pytest.raises(EndpointError):
        validate_url(b"https://example.com/")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("Example.COM", "example.com"),
        ("example.com.", "example.com."),
        ("b\u00fccher.example", "xn--bcher-kva.example"),
        ("B\u00dcCHER.example", "xn--bcher-kva.example"),
        (
            "\u043f\u0440\u0438\u043c\u0435\u0440.\u0438\u0441\u043f\u044b\u0442\u0430\u043d\u0438\u0435",
            "xn--e1afmkfd.xn--80akhbyknj4f",
        ),
        ("[::FFFF:7F00:1]", "::ffff:7f00:1"),
        ("2001:DB8:0:0::1", "2001:db8::1"),
        ("\uff4c\uff4f\uff43\uff41\uff4c\uff48\uff4f\uff53\uff54", "localhost"),
    ],
)
def test_normalise_host(host: str, expected: str) -> None:
    assert normalise_host(host) == expected


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("localhost", True),
        ("LocalHost", True),
        ("localhost.", False),  # fully qualified: the DNS may answer it
        ("localhost.localdomain", False),
        ("ip6-localhost", False),
        ("\uff4c\uff4f\uff43\uff41\uff4c\uff48\uff4f\uff53\uff54", True),  # full-width
        ("api.localhost", False),
        ("127.0.0.1", True),
        ("127.255.0.9", True),
        ("[::1]", True),
        ("::1", True),
        ("localhost.example.com", False),
        ("10.0.0.1", False),
        ("::ffff:127.0.0.1", False),
        ("example.com", False),
    ],
)
def test_is_loopback_host(host: str, expected: bool) -> None:
    assert is_loopback_host(host) is expected


def test_redacted_keeps_only_scheme_host_and_port() -> None:
    assert (
        redacted("https://u:p@hooks.example.com:8443/x?token=1") == "https://hooks.example.com:8443"
    )
    assert redacted("https://[::1/") == "(unparseable url)"


def test_check_url_address_refuses_literal_addresses_at_start_up() -> None:
    check_url_address("https://hooks.example.com/")  # names are checked when resolved
    check_url_address("https://93.184.216.34/")
    check_url_address("http://127.0.0.1:9000/")  # an explicitly configured loopback URL
    check_url_address("http://[::1]:9000/")
    with pytest.raises(EndpointError, match=r"10\.1\.2\.3 is refused: a private address"):
        check_url_address("https://10.1.2.3/")
    with pytest.raises(EndpointError, match="cloud metadata"):
        check_url_address("https://[::ffff:169.254.169.254]/")
    check_url_address("https://10.1.2.3/", allowed_networks=[net("10.0.0.0/8")])


# --- address policy: check_address --------------------------------------------------------------


@pytest.mark.parametrize(
    "address",
    [
        "93.184.216.34",
        "8.8.8.8",
        "1.1.1.1",
        "2606:4700:4700::1111",
        "2a00:1450:4001:80b::200e",
        "::ffff:8.8.8.8",
        "::ffff:0:808:808",
        "64:ff9b::8.8.8.8",
        "2002:808:808::1",
        "2001:0:808:808:0:0:f7f7:f7f7",  # Teredo: server 8.8.8.8, client 8.8.8.8
        ipaddress.ip_address("8.8.4.4"),
    ],
)
def test_public_addresses_pass(address: str) -> None:
    assert check_address(address) is None


def test_loopback_passes_only_when_allowed() -> None:
    for address in ("127.0.0.1", "127.1.2.3", "::1", "::ffff:127.0.0.1"):
        assert check_address(address) is not None
        assert check_address(address, allow_loopback=True) is None
    assert check_address("10.0.0.1", allow_loopback=True) == "a private address (10.0.0.0/8)"


def test_allowed_networks_open_only_what_they_contain() -> None:
    allowed = [net("10.20.0.0/16"), net("fd12:3456::/32")]
    assert check_address("10.20.3.4", allowed_networks=allowed) is None
    assert check_address("::ffff:10.20.3.4", allowed_networks=allowed) is None
    assert check_address("64:ff9b::10.20.3.4", allowed_networks=allowed) is None
    assert check_address("fd12:3456::1", allowed_networks=allowed) is None
    assert check_address("10.21.0.1", allowed_networks=allowed) == "a private address (10.0.0.0/8)"
    assert check_address("fd12:3457::1", allowed_networks=allowed) is not None
    assert check_address("127.0.0.1", allowed_networks=[net("127.0.0.0/8")]) is None


@pytest.mark.parametrize(
    "address",
    [
        "169.254.169.254",
        "fd00:ec2::254",
        "::ffff:169.254.169.254",
        "64:ff9b::a9fe:a9fe",
        "100.100.100.200",
        "0.0.0.0",
        "0.1.2.3",
        "::",
        "255.255.255.255",
        "224.0.0.1",
        "239.255.255.250",
        "ff02::1",
        "::ffff:224.0.0.1",
    ],
)
def test_some_addresses_are_never_allowed(address: str) -> None:
    everything = [net("0.0.0.0/0"), net("::/0")]
    assert check_address(address, allow_loopback=True, allowed_networks=everything) is not None


def test_reasons_name_the_kind_and_the_embedded_address() -> None:
    assert check_address("::ffff:10.0.0.1") == (
        "an IPv4-mapped address of 10.0.0.1, a private address (10.0.0.0/8)"
    )
    assert check_address("2002:a9fe:a9fe::1") == (
        "a 6to4 address of 169.254.169.254, a cloud metadata service address"
    )
    assert check_address("fd00:ec2::254") == "a cloud metadata service address"
    assert check_address("fe80::1%eth0") == "a link-local address (fe80::/10)"
    assert check_address("not-an-ip") == "not an IP address"
    assert check_address(12) == "not an IP address"  # type: ignore[arg-type]


# --- SafeResolver -----------------------------------------------------------------------------


async def test_safe_resolver_returns_only_the_allowed_addresses(
    caplog: pytest.LogCaptureFixture,
) -> None:
    inner = FakeResolver("10.0.0.5", "93.184.216.34", "::ffff:127.0.0.1", "2606:4700::1111")
    resolver = SafeResolver(False, resolver=inner)
    with caplog.at_level(logging.WARNING, logger="fluxora_webhooks.connector"):
        answers = await resolver.resolve("mixed.example", 443, socket.AF_UNSPEC)
    assert [a["host"] for a in answers] == ["93.184.216.34", "2606:4700::1111"]
    assert all(a["port"] == 443 and a["hostname"] == "mixed.example" for a in answers)
    assert "skipped 2 refused address(es)" in caplog.text
    assert inner.lookups == ["mixed.example"]


async def test_safe_resolver_refuses_a_host_with_no_allowed_address() -> None:
    resolver = SafeResolver(False, resolver=FakeResolver("10.0.0.5", "fd00::1"))
    with pytest.raises(AddressRefused) as caught:
        await resolver.resolve("internal.example", 443)
    exc = caught.value
    assert isinstance(exc, EndpointError) and isinstance(exc, FluxoraError)
    assert isinstance(exc, OSError) and exc.errno == errno.EACCES
    assert (exc.host, exc.address) == ("internal.example", "10.0.0.5")
    assert str(exc) == (
        "internal.example: refused to connect to 10.0.0.5, a private address (10.0.0.0/8); "
        "add it to WEBHOOK_ALLOWED_NETWORKS if this consumer is intended"
    )


async def test_never_allowed_addresses_get_no_allow_list_hint() -> None:
    resolver = SafeResolver(False, resolver=FakeResolver("169.254.169.254"))
    with pytest.raises(AddressRefused) as caught:
        await resolver.resolve("metadata.example", 80)
    assert "cloud metadata" in str(caught.value)
    assert "WEBHOOK_ALLOWED_NETWORKS" not in str(caught.value)


async def test_safe_resolver_applies_loopback_and_allowed_networks() -> None:
    inner = FakeResolver("127.0.0.1", "::1", "10.1.1.1")
    assert [a["host"] for a in await SafeResolver(True, resolver=inner).resolve("h")] == [
        "127.0.0.1",
        "::1",
    ]
    allowed = SafeResolver(False, [net("10.1.0.0/16")], resolver=inner)
    assert [a["host"] for a in await allowed.resolve("h")] == ["10.1.1.1"]


async def test_safe_resolver_times_out() -> None:
    resolver = SafeResolver(False, resolver=FakeResolver("8.8.8.8", delay=10), timeout=0.05)
    with pytest.raises(OSError) as caught:
        await asyncio.wait_for(resolver.resolve("slow.example"), 2)
    assert caught.value.errno == errno.ETIMEDOUT
    assert not isinstance(caught.value, EndpointError)
    assert "slow.example" in str(caught.value)


async def test_an_empty_answer_is_an_os_error() -> None:
    with pytest.raises(OSError) as caught:
        await SafeResolver(False, resolver=FakeResolver()).resolve("nothing.example")
    assert not isinstance(caught.value, EndpointError)


async def test_safe_resolver_leaves_a_given_resolver_open() -> None:
    inner = FakeResolver("8.8.8.8")
    await SafeResolver(False, resolver=inner).close()
    assert not inner.closed


async def test_safe_resolver_defaults_to_the_threaded_resolver() -> None:
    resolver = SafeResolver(True)
    answers = await resolver.resolve("127.0.0.1", 80)  # numeric: no DNS traffic
    assert [a["host"] for a in answers] == ["127.0.0.1"]
    await resolver.close()


# --- the dispatcher's clients ------------------------------------------------------------------


async def test_each_client_checks_addresses_with_the_configured_policy() -> None:
    settings = Settings(
        webhook_url="https://h.example/", secret=b"x" * 32, allowed_networks=(net("10.0.0.0/8"),)
    )
    strict = make_client(settings)
    loopback = make_client(settings, allow_loopback=True, require_loopback=True)
    try:
        assert strict.resolver.allowed_networks == (net("10.0.0.0/8"),)
        assert strict.resolver.check("10.1.2.3") is None
        assert strict.resolver.check("127.0.0.1") is not None
        assert strict.resolver.check("8.8.8.8") is None
        assert loopback.resolver.check("127.0.0.1") is None
        assert loopback.resolver.check("8.8.8.8") is not None  # plain http: loopback only
        assert DNS_CACHE_S <= 60
    finally:
        await strict.close()
        await loopback.close()


@pytest.mark.parametrize(
    ("url", "hint"),
    [
        ("http://127.0.0.1:9/x", "127.0.0.0/8"),
        ("https://10.0.0.1/x", "10.0.0.1/32 for this address alone"),
        ("http://[::1]:9/x", "::1/128"),
        ("https://[fd00::1]/x", "fd00::1/128 for this address alone"),
        ("https://169.254.169.254/x", None),  # never allowed: no hint
        ("https://0.0.0.0/x", None),
    ],
)
def test_a_refused_registered_address_says_how_to_allow_it_only_where_it_can_be(
    url: str, hint: str | None
) -> None:
    with pytest.raises(EndpointError) as caught:
        check_url_address(url, registered=True)
    message = str(caught.value)
    if hint is None:
        assert "WEBHOOK_ALLOWED_NETWORKS" not in message
    else:
        assert f"WEBHOOK_ALLOWED_NETWORKS allows it ({hint}" in message
        assert "127.0.0.0/8" not in message or "127.0.0.1" in url
