"""Property tests: whatever arrives, the policies and the verifier fail only in their own
error types, and genuine signatures always verify."""

from __future__ import annotations

import ipaddress
import string

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fluxora_webhooks.errors import EndpointError, VerificationError
from fluxora_webhooks.signing import Signer, verify
from fluxora_webhooks.urlpolicy import check_address, normalise_host, validate_url

SECRET = b"fuzzing-secret-0123456789abcdef"
NOW = 1_750_000_000
FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])

HEADER_NAMES = (
    "webhook-id",
    "webhook-timestamp",
    "webhook-signature",
    "x-fluxora-delivery-id",
    "x-fluxora-timestamp",
    "x-fluxora-signature",
    "Webhook-Signature",
    "X-Fluxora-Signature",
)

# --- validate_url -----------------------------------------------------------------------------

hosts = st.one_of(
    st.text(min_size=0, max_size=80),
    st.text(alphabet=string.ascii_letters + string.digits + ".-_", min_size=1, max_size=80),
    st.ip_addresses().map(lambda a: f"[{a}]" if a.version == 6 else str(a)),
    st.sampled_from(
        ["localhost", "xn--", "xn--bcher-kva", "\uff4c\uff4f\uff43\uff41\uff4c", "127.1"]
    ),
)
urls = st.one_of(
    st.text(max_size=200),
    st.builds(
        lambda scheme, userinfo, host, port, rest: f"{scheme}://{userinfo}{host}{port}{rest}",
        st.sampled_from(["https", "http", "HTTPS", "ftp", "", "javascript", "h\u0442tps"]),
        st.sampled_from(["", "user@", "user:pw@", ":@", "@"]),
        hosts,
        st.sampled_from(["", ":443", ":0", ":99999", ":-1", ":x", ":"]),
        st.text(max_size=40),
    ),
)


@FUZZ
@given(urls)
@example("https://[::1")
@example("https://\udcff.example/")
@example("https://example.com:\uff11/")
@example("https://a\x00b.example/")
@example("https://" + "a." * 200 + "com/")
def test_validate_url_only_raises_endpoint_error(url: str) -> None:
    try:
        validate_url(url)
    except EndpointError as exc:
        assert len(str(exc)) < 300  # a huge or hostile URL is never echoed whole


@FUZZ
@given(st.text(max_size=100))
def test_normalise_host_only_raises_endpoint_error_and_returns_ascii(host: str) -> None:
    try:
        result = normalise_host(host)
    except EndpointError:
        return
    assert result.isascii()
    assert result == result.lower()


@FUZZ
@given(urls)
def test_an_accepted_url_is_https_or_loopback_http(url: str) -> None:
    try:
        validate_url(url)
    except EndpointError:
        return
    scheme = url.split(":", 1)[0].lower()
    assert scheme in ("https", "http")
    assert "@" not in url.split("/")[2]


# --- check_address ----------------------------------------------------------------------------

# Ranges where the IPv6 address stands for an IPv4 one: the embedded address decides.
EMBEDDING = [
    ipaddress.ip_network(n)
    for n in ("::ffff:0:0/96", "::ffff:0:0:0/96", "64:ff9b::/96", "2002::/16", "2001::/32")
]


@FUZZ
@given(st.ip_addresses())
def test_every_non_global_address_is_refused(
    address: ipaddress.IPv4Address | ipaddress.IPv6Address,
) -> None:
    reason = check_address(address)
    if any(address.version == n.version and address in n for n in EMBEDDING):
        return
    if not address.is_global or address.is_multicast:
        assert reason is not None, address


@FUZZ
@given(st.ip_addresses(v=4))
def test_mapped_and_nat64_forms_follow_the_ipv4_address(address: ipaddress.IPv4Address) -> None:
    refused = check_address(address) is not None
    for form in (f"::ffff:{address}", f"64:ff9b::{address}"):
        assert (check_address(form) is not None) is refused, form
    six_to_four = ipaddress.IPv6Address((0x2002 << 112) | (int(address) << 80) | 1)
    assert (check_address(six_to_four) is not None) is refused


@FUZZ
@given(st.one_of(st.text(max_size=60), st.integers(), st.none(), st.binary(max_size=20)))
def test_check_address_never_raises(value: object) -> None:
    result = check_address(value)  # type: ignore[arg-type]
    assert result is None or isinstance(result, str)


# --- verify -----------------------------------------------------------------------------------

header_values = st.one_of(
    st.text(max_size=120),
    st.binary(max_size=60),
    st.integers(),
    st.none(),
    st.lists(st.text(max_size=5), max_size=3),
    st.from_regex(r"v1,[A-Za-z0-9+/=]{0,60}( v1,[A-Za-z0-9+/=]{0,60})*", fullmatch=True),
    st.from_regex(r"[0-9a-f]{64}", fullmatch=True),
    st.integers(min_value=NOW - 1000, max_value=NOW + 1000).map(str),
)
header_maps = st.dictionaries(
    st.one_of(st.sampled_from(HEADER_NAMES), st.text(max_size=20)), header_values, max_size=8
)


@FUZZ
@given(st.binary(max_size=300), header_maps)
def test_verify_only_raises_verification_error(body: bytes, headers: dict[str, object]) -> None:
    try:
        verify(body, headers, SECRET, now=NOW)  # type: ignore[arg-type]
    except VerificationError as exc:
        assert exc.reason in {
            "missing_header",
            "bad_timestamp",
            "timestamp_too_old",
            "timestamp_too_new",
            "bad_signature",
            "no_matching_signature",
        }
        assert SECRET.decode() not in str(exc)
    else:
        raise AssertionError("random headers verified")


@FUZZ
@given(
    body=st.binary(max_size=500),
    delivery_id=st.text(
        alphabet=st.characters(blacklist_categories=["Cs"]), min_size=1, max_size=40
    ).filter(lambda s: s.strip() == s and s.isprintable()),
    skew=st.integers(min_value=-300, max_value=300),
    drop_standard=st.booleans(),
)
def test_genuine_signatures_verify(
    body: bytes, delivery_id: str, skew: int, drop_standard: bool
) -> None:
    headers = Signer(SECRET).headers(
        delivery_id=delivery_id, event_type="e", attempt=1, body=body, timestamp=NOW + skew
    )
    if drop_standard:
        headers = {k: v for k, v in headers.items() if not k.startswith("webhook-")}
    assert verify(body, headers, SECRET, now=NOW) == delivery_id


@FUZZ
@given(body=st.binary(min_size=1, max_size=300), data=st.data(), drop_standard=st.booleans())
def test_any_changed_byte_fails(body: bytes, data: st.DataObject, drop_standard: bool) -> None:
    headers = Signer(SECRET).headers(
        delivery_id="d-1", event_type="e", attempt=1, body=body, timestamp=NOW
    )
    if drop_standard:
        headers = {k: v for k, v in headers.items() if not k.startswith("webhook-")}
    index = data.draw(st.integers(min_value=0, max_value=len(body) - 1))
    flip = data.draw(st.integers(min_value=1, max_value=255))
    tampered = bytearray(body)
    tampered[index] ^= flip
    try:
        verify(bytes(tampered), headers, SECRET, now=NOW)
    except VerificationError as exc:
        assert exc.reason == "no_matching_signature"
    else:
        raise AssertionError("a tampered body verified")
