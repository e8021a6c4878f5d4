"""Endpoint safety, part one: the URL policy and the address policy.

URL policy (:func:`validate_url`), applied to a consumer URL when it is configured:
``https`` only (``http`` for a loopback host), no credentials, a host that is a valid
(possibly internationalised) host name or IP literal, parsed the same way by the standard
library and by the HTTP client.

Address policy (:func:`check_address`), applied at connect time to every address a host
resolves to (by the connector of :mod:`.connector`, which pins each connection to an
address that passed).
"""

from __future__ import annotations

import ipaddress
import re
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import idna
import yarl

from .errors import EndpointError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# The one name that means loopback by definition (RFC 6761: it must resolve to loopback).
# Not "localhost." (a fully qualified name that reaches the DNS), "localhost.localdomain"
# or "ip6-localhost" (conventions of a hosts file, which a resolver may answer otherwise).
LOOPBACK_NAMES = frozenset({"localhost"})

_MAX_SHOWN = 80  # characters of a host name shown in a message

# --- URL policy -----------------------------------------------------------------------------

# Code points that IDNA mapping deletes silently (so "e<ZWSP>vil.com" would become
# "evil.com"): a host containing one is refused rather than rewritten.
_INVISIBLE = re.compile(
    "[\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u1806\u180b-\u180f\u200b-\u200f"
    "\u202a-\u202e\u2060-\u206f\u3164\ufe00-\ufe0f\ufeff\uffa0\ufff0-\ufff8"
    "\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0000-\U000e0fff]"
)
# One label of a host name once encoded: letters, digits, hyphens (underscores occur in
# real names and are harmless), 1 to 63 characters.
_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?", re.ASCII)
# A last label that is a number makes the whole name an IPv4 address to the resolver.
_NUMERIC_LABEL = re.compile(r"[0-9]+|0x[0-9a-f]*", re.ASCII)


def shown_host(host: str) -> str:
    """A host as it may appear in a message: bounded, and safe to print."""
    text = host if len(host) <= _MAX_SHOWN else host[:_MAX_SHOWN] + "..."
    return ascii(text)[1:-1]


def has_space_or_control(text: str) -> bool:
    """Whitespace or a control character anywhere. URL parsers drop tabs and newlines
    silently (a tab inside a host makes another host), so such a URL is refused whole."""
    return any(ch.isspace() or unicodedata.category(ch) == "Cc" for ch in text)


# The bidirectional embeddings, overrides and isolates (U+202A-202E, U+2066-2069): one
# reverses or reorders the text that follows it where it is shown.
BIDI_CONTROLS = re.compile("[\u202a-\u202e\u2066-\u2069]")


def validate_kept_url(url: str) -> None:
    """:func:`validate_url` for a URL given to be kept (registered, configured), which also
    refuses an invisible formatting character (Unicode category Cf: the bidirectional
    overrides and isolates, zero-width spaces and joiners, the byte order mark, the soft
    hyphen). Shown, such a character changes what the URL appears to be (a right-to-left
    override shows ``/exe.jpg`` for ``/gpj.exe``), and a host name's IDNA mapping drops
    some silently. A URL stored before this check is still sent to (the dispatcher checks
    it with :func:`validate_url`); only new ones are refused."""
    validate_url(url)
    for ch in url:
        if unicodedata.category(ch) == "Cf":
            raise EndpointError(
                f"the URL contains an invisible formatting character (U+{ord(ch):04X}), which"
                " changes how it is shown; percent-encode it, or remove it"
            )


def is_loopback_host(host: str) -> bool:
    """True for ``localhost``, 127.0.0.0/8 and ::1 written literally in a URL.

    The host is normalised first (:func:`normalise_host`, as the HTTP client will use it),
    so start-up and connect time decide from the same name: a full-width ``localhost`` is
    ``localhost`` to both.
    """
    try:
        name = normalise_host(host)
    except EndpointError:
        return False
    # Only the name that means loopback everywhere; not "*.localhost" or "localhost.",
    # which a resolver could answer with a public address.
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class LoopbackRule:
    """What a consumer URL's scheme and host mean for the addresses connected to.

    ``allow``: the configured host is loopback, so loopback addresses may be connected to.
    ``require``: the URL is plain ``http`` (allowed for loopback only), so every address
    connected to must be loopback: a name that resolves elsewhere gets no unencrypted
    request.
    """

    allow: bool
    require: bool


def loopback_rule(url: str) -> LoopbackRule:
    """The :class:`LoopbackRule` of a URL that passed :func:`validate_url`."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
    except ValueError:
        return LoopbackRule(allow=False, require=True)  # unusable: nothing may pass
    loopback = is_loopback_host(host)
    return LoopbackRule(allow=loopback, require=parts.scheme.lower() == "http")


def normalise_host(host: str) -> str:
    """The host as the HTTP client will use it: lowercase, IDNA-encoded (punycode).

    IP literals come back in their compressed form. Raises :class:`EndpointError` for a
    host that is not a valid host name, cannot be IDNA-encoded, or holds invisible
    characters that IDNA would delete.
    """
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        return str(ipaddress.ip_address(bare))
    except ValueError:
        pass
    if not bare:
        raise EndpointError("the URL has no host")
    shown = shown_host(bare)
    if bare.isascii():
        encoded = bare.lower()
        for label in encoded.split("."):
            if label.startswith("xn--") and not _punycode_ok(label):
                raise EndpointError(f"the host {shown} has a label that is not valid punycode")
    else:
        if _INVISIBLE.search(bare):
            raise EndpointError(f"the host {shown} contains an invisible character")
        try:
            encoded = _idna_encode(bare)
        except UnicodeError:
            raise EndpointError(
                f"the host {shown} is not a valid internationalised domain name (IDNA)"
            ) from None
    name = encoded[:-1] if encoded.endswith(".") else encoded
    if len(name) > 253 or not all(_LABEL.fullmatch(label) for label in name.split(".")):
        raise EndpointError(f"the host {shown} is not a valid host name")
    if _NUMERIC_LABEL.fullmatch(name.rsplit(".", 1)[-1]):
        # "127.1", "2130706433", "0x7f.1": getaddrinfo reads these as IPv4 addresses and
        # aiohttp refuses them at connect time; say so now instead.
        raise EndpointError(
            f"the host {shown} is a non-standard IPv4 form; write the address as a.b.c.d"
        )
    return encoded


def _idna_encode(host: str) -> str:
    # The HTTP client (yarl) encodes with IDNA 2008 / UTS 46 and falls back to IDNA 2003
    # (which still admits names such as emoji domains); do the same so both agree.
    try:
        return idna.encode(host, uts46=True).decode("ascii")
    except UnicodeError:
        return host.encode("idna").decode("ascii")


def _punycode_ok(label: str) -> bool:
    try:
        idna.decode(label)
        return True
    except UnicodeError:
        pass
    try:
        label.encode("ascii").decode("idna")
        return True
    except UnicodeError:
        return False


def validate_url(url: str) -> None:
    """Apply the URL policy. Raises :class:`EndpointError` (the message names no secret).

    - ``https`` is required; ``http`` only for a loopback host (``localhost`` or a
      loopback IP literal; at connect time every address must then be loopback too).
    - Whitespace and control characters are refused anywhere in the URL (never cleaned).
    - Credentials in the URL are refused; so is every other scheme.
    - The host must be a valid host name (IDNA/punycode hosts are normalised first) or an
      IP literal without a zone identifier, and the HTTP client must read the same host
      from the URL; port 0 is refused (the client would connect to the default port).
    """
    if not isinstance(url, str):
        raise EndpointError("the URL must be a string")
    if has_space_or_control(url):
        raise EndpointError(
            "the URL contains whitespace or a control character (percent-encode it, or remove it)"
        )
    try:
        parts = urlsplit(url)
        host = parts.hostname
        port = parts.port  # raises ValueError on a bad port
    except ValueError:
        raise EndpointError("the URL cannot be parsed") from None
    scheme = parts.scheme.lower()
    if scheme not in ("https", "http"):
        raise EndpointError(f"scheme {shown_host(scheme) or '(none)'!r} is not allowed; use https")
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise EndpointError("URLs with embedded credentials are not allowed")
    if not host:
        raise EndpointError("the URL has no host")
    if port == 0:
        raise EndpointError("port 0 is no port to connect to; write the consumer's port")
    if "[" in parts.netloc and not _is_ip(host.partition("%")[0], version=6):
        # "[v1.x]" (an RFC 3986 IPvFuture literal): both parsers read it as the name v1.x.
        raise EndpointError(
            f"the host [{shown_host(host)}] is in brackets but is no IPv6 address; write a"
            " host name without brackets"
        )
    if "%" in host and _is_ip(host.partition("%")[0], version=6):
        # "[fe80::1%25eth0]": the zone names an interface of one host (RFC 6874) and an
        # HTTP request may not carry it; the client can neither connect with it nor drop it.
        raise EndpointError(
            f"the host [{shown_host(host)}] has a zone identifier (%...), which names a"
            " network interface of the sending host; write the address without it"
        )
    normalised = normalise_host(host)
    _check_client_agrees(url, normalised)
    if scheme == "http" and not is_loopback_host(normalised):
        raise EndpointError(
            f"https is required for {shown_host(normalised)} (http is allowed for loopback only)"
        )


def _check_client_agrees(url: str, normalised: str) -> None:
    """Refuse a URL that aiohttp (yarl) would read differently from the standard library."""
    try:
        client_url = yarl.URL(url)
        client_host = client_url.raw_host
        _ = client_url.host, client_url.port  # decoding can fail too
    except (ValueError, UnicodeError):
        raise EndpointError("the URL cannot be parsed by the HTTP client") from None
    if client_host is None:
        raise EndpointError("the URL has no host")
    if client_host == normalised:
        return
    try:
        if ipaddress.ip_address(client_host) == ipaddress.ip_address(normalised):
            return
    except ValueError:
        pass
    raise EndpointError(
        f"the host {shown_host(normalised)} is ambiguous: the HTTP client reads it differently"
    )


def check_url_address(
    url: str, *, allowed_networks: Sequence[IPNetwork] = (), registered: bool = False
) -> None:
    """At start-up: refuse a URL whose host is an IP literal the address policy refuses.

    Host names are checked when they are resolved, at connect time; an IP literal can be
    checked at once, so a URL that could never be delivered to stops start-up instead.
    Call after :func:`validate_url`. Raises :class:`EndpointError`.

    ``registered``: the URL of an endpoint registered through the CLI or the API, not the
    operator's own configuration. Loopback is then refused like any private range (also
    the name ``localhost``) unless ``allowed_networks`` allows it.
    """
    try:
        host = urlsplit(url).hostname
    except ValueError:
        raise EndpointError("the URL cannot be parsed") from None
    if not host:
        raise EndpointError("the URL has no host")
    if registered and is_loopback_host(host) and not _is_ip(host):
        host = "127.0.0.1"  # the name localhost reaches loopback: judge it as loopback
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return  # a host name: checked when resolved
    reason = check_address(
        address,
        allow_loopback=is_loopback_host(host) and not registered,
        allowed_networks=allowed_networks,
    )
    if reason is not None:
        hint = ""
        if registered and never_allowed_reason(address) is None:
            if address.is_loopback:
                example = "::1/128" if address.version == 6 else "127.0.0.0/8"
                where = "for a consumer on this host"
            else:
                example = f"{address}/{address.max_prefixlen}"
                where = "for this address alone"
            hint = (
                "; a registered endpoint reaches a private or loopback address only when"
                f" the service's WEBHOOK_ALLOWED_NETWORKS allows it ({example} {where})"
            )
        raise EndpointError(f"the URL's host {address} is refused: {reason}{hint}")


def _is_ip(text: str, *, version: int | None = None) -> bool:
    """An IP address (of that ``version`` if given), brackets aside."""
    try:
        address = ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return False
    return version is None or address.version == version


def redacted(url: str) -> str:
    """Scheme and host (and port) only: safe to log."""
    try:
        parts = urlsplit(url)
        return f"{parts.scheme}://{parts.netloc.rsplit('@', 1)[-1]}"
    except ValueError:
        return "(unparseable url)"


# --- address policy -------------------------------------------------------------------------


def _nets(*cidrs: str) -> tuple[IPNetwork, ...]:
    return tuple(ipaddress.ip_network(c) for c in cidrs)


# Never a webhook consumer, whatever WEBHOOK_ALLOWED_NETWORKS says: connecting to 0.0.0.0
# reaches the local host on Linux, multicast and broadcast are not TCP peers, and the cloud
# metadata services hand out credentials.
_METADATA = frozenset(
    ipaddress.ip_address(a)
    for a in (
        "169.254.169.254",  # AWS, GCP, Azure, OpenStack, DigitalOcean, ... instance metadata
        "169.254.169.253",  # AWS DNS resolver
        "169.254.169.123",  # AWS time sync
        "169.254.170.2",  # AWS ECS task metadata
        "169.254.170.23",  # AWS EKS pod identity
        "169.254.0.23",  # Tencent Cloud metadata
        "100.100.100.200",  # Alibaba Cloud metadata
        "192.0.0.192",  # Oracle Cloud metadata (legacy)
        "fd00:ec2::254",  # AWS instance metadata (IPv6)
        "fd00:ec2::253",  # AWS DNS resolver (IPv6)
        "fd00:ec2::123",  # AWS time sync (IPv6)
        "fd00:ec2::23",  # AWS EKS pod identity (IPv6)
        "fd20:ce::254",  # GCP metadata (IPv6)
    )
)
_FIXED: tuple[tuple[IPNetwork, str], ...] = (
    (ipaddress.ip_network("0.0.0.0/8"), "an unspecified ('this network') address (0.0.0.0/8)"),
    (ipaddress.ip_network("255.255.255.255/32"), "the broadcast address"),
    (ipaddress.ip_network("224.0.0.0/4"), "a multicast address (224.0.0.0/4)"),
    (ipaddress.ip_network("::/128"), "the unspecified address (::)"),
    (ipaddress.ip_network("ff00::/8"), "a multicast address (ff00::/8)"),
)
LOOPBACK_NETWORKS = _nets("127.0.0.0/8", "::1/128")
_LOOPBACK = LOOPBACK_NETWORKS
# Refused unless inside WEBHOOK_ALLOWED_NETWORKS (loopback also when the URL is loopback).
_BLOCKED: tuple[tuple[IPNetwork, str], ...] = tuple(
    (ipaddress.ip_network(cidr), f"{kind} ({cidr})")
    for cidr, kind in (
        ("127.0.0.0/8", "a loopback address"),
        ("10.0.0.0/8", "a private address"),
        ("172.16.0.0/12", "a private address"),
        ("192.168.0.0/16", "a private address"),
        ("100.64.0.0/10", "a shared (CGNAT) address"),
        ("169.254.0.0/16", "a link-local address"),
        ("192.0.0.0/24", "an IETF protocol assignment address"),
        ("192.0.2.0/24", "a documentation address"),
        ("198.51.100.0/24", "a documentation address"),
        ("203.0.113.0/24", "a documentation address"),
        ("198.18.0.0/15", "a benchmarking address"),
        ("192.88.99.0/24", "a 6to4 relay anycast address (deprecated)"),
        ("240.0.0.0/4", "a reserved address"),
        ("::1/128", "the loopback address"),
        ("100::/64", "a discard-only address"),
        ("2001:2::/48", "a benchmarking address"),
        ("2001:db8::/32", "a documentation address"),
        ("3fff::/20", "a documentation address"),
        ("2001::/23", "an IETF protocol assignment address"),
        ("fc00::/7", "a private (unique local) address"),
        ("fe80::/10", "a link-local address"),
        ("fec0::/10", "a site-local address (deprecated)"),
    )
)
_GLOBAL_UNICAST = ipaddress.ip_network("2000::/3")
_MAPPED = ipaddress.ip_network("::ffff:0:0/96")
_TRANSLATED = ipaddress.ip_network("::ffff:0:0:0/96")
_COMPATIBLE = ipaddress.ip_network("::/96")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")
_SIX_TO_FOUR = ipaddress.ip_network("2002::/16")
_TEREDO = ipaddress.ip_network("2001::/32")


def _embedded(address: ipaddress.IPv6Address) -> list[tuple[str, ipaddress.IPv4Address]]:
    """The IPv4 addresses an IPv6 address embeds (traffic to it reaches them)."""
    n = int(address)
    last32 = ipaddress.IPv4Address(n & 0xFFFFFFFF)
    if address in _MAPPED:
        return [("an IPv4-mapped address", last32)]
    if address in _TRANSLATED:
        return [("an IPv4-translated address", last32)]
    if address in _NAT64:
        return [("a NAT64 address (64:ff9b::/96)", last32)]
    if address in _NAT64_LOCAL:
        # RFC 8215 lets the operator choose the prefix length, and so where the IPv4 address
        # sits; the usual /96 form is checked (and the whole prefix is refused below).
        return [("a local-use NAT64 address (64:ff9b:1::/48)", last32)]
    if address in _SIX_TO_FOUR:
        return [("a 6to4 address", ipaddress.IPv4Address((n >> 80) & 0xFFFFFFFF))]
    if address in _TEREDO:
        server, client = address.teredo or (last32, last32)
        return [("a Teredo address (server)", server), ("a Teredo address (client)", client)]
    if address in _COMPATIBLE and n > 1:  # :: and ::1 are themselves, not embeddings
        return [("an IPv4-compatible address", last32)]
    return []


def parse_ip(ip: object) -> IPAddress | None:
    if isinstance(ip, ipaddress.IPv4Address | ipaddress.IPv6Address):
        address: IPAddress = ip
    elif isinstance(ip, str):
        try:
            address = ipaddress.ip_address(ip.strip().strip("[]"))
        except ValueError:
            return None
    else:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.scope_id:
        address = ipaddress.IPv6Address(int(address))  # the zone does not change the range
    return address


def never_allowed_reason(address: IPAddress) -> str | None:
    if address in _METADATA:
        return "a cloud metadata service address"
    for network, reason in _FIXED:
        if address in network:
            return reason
    if isinstance(address, ipaddress.IPv6Address):
        for label, inner in _embedded(address):
            inner_reason = never_allowed_reason(inner)
            if inner_reason is not None:
                return f"{label} of {inner}, {inner_reason}"
    return None


def check_address(
    ip: str | IPAddress,
    *,
    allow_loopback: bool = False,
    allowed_networks: Sequence[IPNetwork] = (),
) -> str | None:
    """The reason the address policy refuses ``ip``, or None if it may be connected to.

    Refused: private, loopback (unless ``allow_loopback``), link-local, shared (CGNAT),
    IETF-reserved, documentation, benchmarking and discard ranges, and the IPv6 forms that
    embed a refused IPv4 address (mapped, translated, compatible, NAT64, 6to4, Teredo).
    ``allowed_networks`` (``WEBHOOK_ALLOWED_NETWORKS``) lets any of those through; it never
    lets through the unspecified, broadcast and multicast addresses or a cloud metadata
    service. A value that is not an IP address is refused.
    """
    address = parse_ip(ip)
    if address is None:
        return "not an IP address"
    fixed = never_allowed_reason(address)
    if fixed is not None:
        return fixed
    return _overridable_reason(address, allow_loopback, allowed_networks)


def _overridable_reason(
    address: IPAddress, allow_loopback: bool, allowed_networks: Iterable[IPNetwork]
) -> str | None:
    if any(address.version == net.version and address in net for net in allowed_networks):
        return None
    if allow_loopback and any(address in net for net in _LOOPBACK):
        return None
    if isinstance(address, ipaddress.IPv6Address):
        embedded = _embedded(address)
        for label, inner in embedded:
            reason = _overridable_reason(inner, allow_loopback, allowed_networks)
            if reason is not None:
                return f"{label} of {inner}, {reason}"
        if address in _NAT64_LOCAL:
            return "a local-use NAT64 address (64:ff9b:1::/48) whose IPv4 target cannot be known"
        if embedded and address in _COMPATIBLE:
            return "an IPv4-compatible IPv6 address (::/96, deprecated)"
        if embedded:
            return None  # the embedded IPv4 addresses passed: the route is theirs
    for network, reason in _BLOCKED:
        if address in network:
            return reason
    if isinstance(address, ipaddress.IPv6Address) and address not in _GLOBAL_UNICAST:
        return "a reserved address (outside 2000::/3)"
    return None
