"""Issue 18 (defects 2, 6, 9): plain http only to loopback, decided from the normalised
host and required of every address connected to; no whitespace or control characters
in a URL.
"""

from __future__ import annotations

import ipaddress

import pytest

from fluxora_webhooks.connector import AddressRefused, SafeResolver
from fluxora_webhooks.errors import EndpointError
from fluxora_webhooks.settings import (
    Settings,
)
from fluxora_webhooks.urlpolicy import is_loopback_host, loopback_rule, validate_url
from tests.support.resolvers import FixedResolver

GOOD = {
    "WEBHOOK_URL": "https://hooks.example.com/in",
    "WEBHOOK_SECRET": "a-long-enough-secret-for-hmac-0123",
}


# --- 2 and 6. http only to loopback, decided from the normalised host -------------------------


@pytest.mark.parametrize(
    "url", ["http://localhost./", "http://localhost.localdomain/", "http://ip6-localhost/"]
)
def test_loopback_looking_names_get_no_plain_http(url: str) -> None:
    with pytest.raises(EndpointError, match="https is required"):
        validate_url(url)


async def test_plain_http_requires_every_address_to_be_loopback() -> None:
    public = SafeResolver(True, resolver=FixedResolver("93.184.216.34"), require_loopback=True)
    with pytest.raises(AddressRefused, match="not a loopback address"):
        await public.resolve("localhost", 80)
    mixed = SafeResolver(
        True, resolver=FixedResolver("93.184.216.34", "127.0.0.1", "::1"), require_loopback=True
    )
    assert [a["host"] for a in await mixed.resolve("localhost", 80)] == ["127.0.0.1", "::1"]
    # WEBHOOK_ALLOWED_NETWORKS widens the address policy, never the plain-http rule.
    everything = [ipaddress.ip_network("0.0.0.0/0")]
    widened = SafeResolver(
        True, everything, resolver=FixedResolver("93.184.216.34"), require_loopback=True
    )
    with pytest.raises(AddressRefused):
        await widened.resolve("localhost", 80)
    assert widened.check("93.184.216.34") is not None  # the socket-level check agrees


def test_full_width_localhost_is_loopback_at_start_up_and_at_connect_time() -> None:
    host = "\uff4c\uff4f\uff43\uff41\uff4c\uff48\uff4f\uff53\uff54"
    Settings.from_env({**GOOD, "WEBHOOK_URL": f"http://{host}:9/x"})
    assert is_loopback_host(host) and loopback_rule(f"http://{host}:9/x").allow


# --- 9. Whitespace and control characters in URLs ----------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "https://hooks.exa\tmple.com/in",
        "https://hooks.example.com/in\n",
        "https://hooks.example.com/i\rn",
        "https://hooks.example.com/in?token=a b",
        "\thttps://hooks.example.com/in",
        "https://hooks.example.com/\x00",
        "https://hooks.example.com/\x7f",
        "https://hooks.example.com/\x85",
        "https://hooks.example.com/\u3000",
    ],
)
def test_urls_with_whitespace_or_control_characters_are_refused(url: str) -> None:
    with pytest.raises(EndpointError, match="whitespace or a control character"):
        validate_url(url)
