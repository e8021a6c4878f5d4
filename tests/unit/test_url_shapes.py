"""Consumer URLs of unusual shapes under the URL policy: a port of 0 and an IPv6 zone
identifier are refused, naming what is wrong; the shapes a consumer may write (IPv6
literals, IDNA hosts, a trailing dot, a default port written out, non-ASCII paths) pass."""

from __future__ import annotations

import ipaddress
import re

import pytest

from fluxora_webhooks.endpoints import check_url
from fluxora_webhooks.errors import ConfigError, EndpointError
from fluxora_webhooks.urlpolicy import validate_url

LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        # The HTTP client takes port 0 for "no port": it would connect to 443 (or 80).
        ("https://hooks.example.com:0/in?token=s3cr3t", "port 0"),
        ("https://hooks.example.com:00/in", "port 0"),
        ("https://[2606:4700::1111]:0/in", "port 0"),
        ("http://127.0.0.1:0/in", "port 0"),
        # The zone names an interface of one host; the client connects without it (or not
        # at all) and would send it in the Host header. RFC 6874 writes the % as %25.
        ("https://[fe80::1%25eth0]/in?token=s3cr3t", "zone identifier"),
        ("https://[fe80::1%eth0]/in", "zone identifier"),
        ("http://[::1%25lo]:8080/in", "zone identifier"),
        ("https://[fe80::1%252]/in", "zone identifier"),
        # A percent-escape after an IPv4 address is no zone: an invalid host name.
        ("https://127.0.0.1%2e/in", "not a valid host name"),
        # RFC 3986's IPvFuture: both parsers read "[v1.x]" as the name v1.x.
        ("https://[v1.x]/in?token=s3cr3t", "in brackets but is no IPv6 address"),
        ("https://[v1.vm]:8443/in", "in brackets but is no IPv6 address"),
    ],
)
def test_port_0_and_an_ipv6_zone_identifier_are_refused(url: str, problem: str) -> None:
    with pytest.raises(EndpointError, match=problem) as refused:
        validate_url(url)
    assert "s3cr3t" not in str(refused.value)
    if problem == "zone identifier":
        assert "/in" not in str(refused.value)
    with pytest.raises(ConfigError, match=problem):
        check_url(url, allowed_networks=(*LOOPBACK, ipaddress.ip_network("fe80::/10")))


@pytest.mark.parametrize(
    "url",
    [
        "http://[::1]:8080/hook",
        "HTTP://[0:0:0:0:0:0:0:1]:8080/hook",
        "https://[2606:4700::1111]:443/hook",
        "https://[64:ff9b::8.8.8.8]/hook",
        "https://Hooks.Example.COM./hook",
        "HTTPS://hooks.example.com:443/hook",
        "https://hooks.example.com:/hook",
        "https://b\u00fccher.example/p\u00e4th?q=\u2713#frag",
        "https://xn--bcher-kva.example/p%C3%A4th?q=%E2%9C%93",
        "https://hooks.example.com/" + "a" * 7000,
        "https://my_host.example.com/hook",  # underscores occur in real names
    ],
)
def test_the_shapes_a_consumer_may_write_pass(url: str) -> None:
    validate_url(url)
    check_url(url, allowed_networks=LOOPBACK)


@pytest.mark.parametrize(
    ("url", "char"),
    [
        ("https://example.com/ok/\u202egpj.exe", "U+202E"),
        ("https://example.com/\u2066x\u2069", "U+2066"),
        ("https://example.com/a\u200bb", "U+200B"),
        ("https://example.com/?q=\ufeff", "U+FEFF"),
    ],
    ids=["rlo", "isolate", "zero-width-space", "bom"],
)
def test_a_url_with_an_invisible_formatting_character_is_not_registered(
    url: str, char: str
) -> None:
    """Shown in a list, a right-to-left override makes '/gpj.exe' read '/exe.jpg'; such a
    URL is refused with the character named, and percent-encoded it is taken."""
    with pytest.raises(ConfigError, match=re.escape(f"invisible formatting character ({char})")):
        check_url(url)
    check_url(url.replace("\u202e", "%E2%80%AE").replace("\u2066", "%E2%81%A6")
              .replace("\u2069", "%E2%81%A9").replace("\u200b", "%E2%80%8B")
              .replace("\ufeff", "%EF%BB%BF"))  # fmt: skip


def test_a_description_with_a_bidirectional_control_is_refused() -> None:
    from fluxora_webhooks.endpoints import check_description

    with pytest.raises(ConfigError, match=r"bidirectional control character \(U\+202E\)"):
        check_description("invoices \u202eftp")
    assert check_description("فواتير العملاء 2026") == "فواتير العملاء 2026"
