"""The endpoint registry: endpoints, their subscriptions and secrets, disable and enable,
rotation, removal and recovery. The one admin layer: the CLI and the API parse and call
these functions; each takes a psycopg connection and does the work in SQL
(``sql/endpoints.sql``), tenant scoping included.

An endpoint is a consumer URL registered for one tenant. Two are built in and configured
from the environment only: ``default`` (``WEBHOOK_URL``, the default tenant, every event
type) and ``operator`` (``WEBHOOK_OPERATOR_URL``, which receives the operator events and
belongs to no tenant). Both can be read; ``default`` can be disabled and enabled; neither
can be updated, rotated or removed through the registry.

Scoping: every function takes ``tenant``. ``None`` acts for every tenant (an admin);
a string restricts the call to that tenant, so another tenant's endpoint is not found.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import os
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from . import clientcerts
from .errors import ConfigError, ConflictError, EndpointError, EndpointLimitReached, NotFoundError
from .outbox import EVENT_TYPE, MAX_EVENT_TYPE, TENANT
from .queries import query
from .secretbox import KEY_VARIABLE, Keyring, SecretLocked, is_sealed, sealed_length
from .secretbox import PREFIX as SEALED_PREFIX
from .settings import environ_keyring, looks_like_duration, parse_duration_ms, retry_rps
from .urlpolicy import (
    BIDI_CONTROLS,
    IPNetwork,
    check_url_address,
    validate_kept_url,
)

log = logging.getLogger(__name__)
DEFAULT_ID = "default"
OPERATOR_ID = "operator"
BUILTIN_IDS = frozenset({DEFAULT_ID, OPERATOR_ID})
# How long after the last dispatcher configuring a built-in endpoint (its variable set) was
# seen a dispatcher without the variable removes it: six housekeeping periods, so one
# restarting or slow to reach the database is not taken for gone.
BUILTIN_SEEN_S = 60
# The tenant of the operator's own events and endpoint: a name no real tenant can have.
OPERATOR_TENANT = "!operator"

DISABLED_REASONS = ("manual", "gone", "failing")
DEFAULT_KEEP_PREVIOUS_MS = 24 * 3_600_000
MAX_KEEP_PREVIOUS_MS = 30 * 86_400_000
MAX_PAGE = 1000
MAX_RATE_LIMIT = 1_000_000
MAX_HEADERS = 32
# Custom headers' size in all, as sent: common servers refuse 8-16 KiB of headers in all
# (ours and the signatures take the rest).
MAX_HEADERS_BYTES = 8192
MAX_DESCRIPTION = 1000
# RFC 9110 4.1 asks senders and recipients to support URIs of at least 8,000 octets; a
# longer one would be refused by many consumers' servers, and is stored and shown everywhere.
MAX_URL_LENGTH = 8000
SECRET_PREFIX = "whsec_"
SECRET_BYTES = 32

# An event type (or a prefix before a trailing '*'): printable ASCII without spaces.
_EVENT_PATTERN = re.compile(r"\*|[!-)+-~]{1,200}\*?", re.ASCII)
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,100}", re.ASCII)
# Ours, or what HTTP itself must decide: an endpoint's custom headers never override them.
RESERVED_HEADERS = frozenset(
    {
        "content-type",
        "content-length",
        "user-agent",
        "host",
        "connection",
        "transfer-encoding",
        "traceparent",
        "tracestate",
    }
)
RESERVED_HEADER_PREFIXES = ("x-fluxora-", "webhook-")
# Refused when an endpoint is created or changed (not in stored rows: a registry written
# before would make their deliveries unusable): headers of one connection's hop (RFC 9110
# 7.6.1), a proxy's, and those that describe the body or ask the consumer to answer
# before it (Expect), which the request does not do.
REFUSED_NEW_HEADERS = frozenset(
    {
        "keep-alive",
        "proxy-connection",
        "proxy-authorization",
        "proxy-authenticate",
        "te",
        "trailer",
        "upgrade",
        "expect",
        "content-encoding",
        "content-range",
    }
)
# What an endpoint's objects (the CLI, the API, the dashboard) show for the value of a
# custom header whose name says it carries a credential: the value is sent, never shown.
# Given back in an update, it stands for the stored value (a read, a change of another
# field or header, and the write of the whole map keep it).
HIDDEN_HEADER_VALUE = "********"
# Words a credential header's name holds anywhere (X-AuthToken, X-ApiKey), and short ones
# only as a whole part of it (X-Api-Key, X-Auth, X-Sig; not X-Author, X-Monkey, X-Signal).
_CREDENTIAL_WORDS = re.compile(
    r"token|secret|passw|passphrase|passcode|credential|cookie|bearer|apikey|authori[sz]ation"
    r"|authenticat|signature|session",
    re.IGNORECASE,
)
_CREDENTIAL_PARTS = frozenset(
    {"auth", "key", "keys", "pass", "pwd", "sig", "jwt", "otp", "hmac", "sid", "creds"}
)


def credential_header(name: str) -> bool:
    """Whether a custom header's name says its value is a credential (``Authorization``,
    ``X-Api-Key``, ``X-Auth-Token``, ``Cookie``...): such a value is never shown."""
    if _CREDENTIAL_WORDS.search(name):
        return True
    return any(part in _CREDENTIAL_PARTS for part in re.split(r"[-_.]", name.lower()))


def shown_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """Custom headers as shown: a credential's value as :data:`HIDDEN_HEADER_VALUE`."""
    return {
        name: HIDDEN_HEADER_VALUE if value and credential_header(name) else value
        for name, value in headers.items()
    }


def resolve_hidden_headers(
    given: Mapping[str, str], stored: Mapping[str, str], name: str = "headers"
) -> dict[str, str]:
    """``given`` with each credential written as :data:`HIDDEN_HEADER_VALUE` (as it was
    shown) replaced by its stored value. One with none stored is refused by name."""
    if not isinstance(given, Mapping):
        return given  # check_headers says what is wrong with it
    by_name = {key.lower(): value for key, value in stored.items()}
    out: dict[str, str] = {}
    for key, value in given.items():
        if isinstance(key, str) and value == HIDDEN_HEADER_VALUE and credential_header(key):
            if key.lower() not in by_name:
                raise ConfigError(
                    name,
                    f"{key}: {HIDDEN_HEADER_VALUE} stands for a stored value, and {key} has"
                    " none; give its value",
                )
            value = by_name[key.lower()]
        out[key] = value
    return out


def seal_headers(
    given: Mapping[str, str],
    stored: Mapping[str, str],
    endpoint_id: str,
    keys: Keyring,
    name: str = "headers",
) -> dict[str, str]:
    """Custom headers as :func:`create` and :func:`update` store them: ``given`` (a
    credential as :data:`HIDDEN_HEADER_VALUE` stands for its value in ``stored``: it stays
    as stored, sealed or not), checked as :func:`check_headers` checks new ones, on the
    values as sent (a value kept sealed counts as long as its plain value), then each
    credential's new value sealed with ``keys`` (bound to the endpoint, as its secret; no
    current key: as given). Other headers' values stay plain."""
    resolved = resolve_hidden_headers(given, stored, name)
    if not isinstance(resolved, Mapping):
        return check_headers(resolved, name, new=True)  # says what is wrong with it
    kept = {
        key
        for key, value in given.items()
        if isinstance(key, str) and value == HIDDEN_HEADER_VALUE and credential_header(key)
    }
    as_sent = {
        key: _as_sent(value) if key in kept and isinstance(value, str) else value
        for key, value in resolved.items()
    }
    checked = check_headers(as_sent, name, new=True)
    return {
        key: resolved[key]
        if key in kept
        else keys.seal(value, endpoint_id)
        if value and credential_header(key)
        else value
        for key, value in checked.items()
    }


def _as_sent(stored: str) -> str:
    """A value kept as stored, as the checks see it: a plain one as it is; for a sealed one
    a stand-in as long as its plain value (ASCII, as checked before it was sealed), what
    the size checks count. One this version cannot read counts as its stored text."""
    size = sealed_length(stored) if is_sealed(stored) else None
    return stored if size is None else "x" * size


def open_headers(stored: Any, endpoint_id: str, keys: Keyring) -> Any:
    """A row's headers with each sealed credential value opened (a plain one as it is),
    as the dispatcher reads them once per reading of the row, never per request. Anything
    but a map is returned as it is. A value no key of ``keys`` opens raises
    :class:`SecretLocked` naming the header, never its value."""
    if not isinstance(stored, Mapping):
        return stored
    out: dict[Any, Any] = {}
    for key, value in stored.items():
        if (
            isinstance(key, str)
            and isinstance(value, str)
            and credential_header(key)
            and is_sealed(value)
        ):
            value = keys.open(value, endpoint_id, f"the value of its header {key}")
        out[key] = value
    return out


def locked_values(endpoint: Endpoint, keys: Keyring) -> list[tuple[str, SecretLocked]]:
    """Why a process holding ``keys`` cannot send to ``endpoint``: each stored value a
    request needs that none of ``keys`` opens (its secret, its previous secret while that
    still signs, its client certificate's key, a credential header's value), as the
    dispatcher reads them (targets). Empty: nothing locked. Each is the value's name
    (``its secret``) and why it does not open (its key id, never the value)."""
    needed: list[tuple[str | None, str]] = [
        (endpoint.secret, "its secret"),
        (endpoint.client_key, "its client certificate's private key"),
    ]
    if endpoint.previous_signs_until() is not None:
        needed.append((endpoint.secret_previous, "its previous secret (still signing)"))
    needed += [
        (value, f"the value of its header {name}")
        for name, value in endpoint.headers.items()
        if credential_header(name)
    ]
    found = [(what, unopenable(stored, endpoint.id, keys, what)) for stored, what in needed]
    return [(what, why) for what, why in found if why is not None]


def unopenable(
    stored: str | None, endpoint_id: str, keys: Keyring, what: str = "its secret"
) -> SecretLocked | None:
    """Why none of ``keys`` opens ``stored`` (sealed), naming it ``what``; None when it
    opens or is not sealed."""
    if not stored or not is_sealed(stored):
        return None
    try:
        keys.open(stored, endpoint_id, what)
    except SecretLocked as exc:
        return exc
    return None


@dataclass(frozen=True)
class Endpoint:
    """One registered endpoint. ``secret`` never appears in :meth:`as_json` or ``repr``.
    ``secret``, ``secret_previous``, ``client_key`` and the values of the credential
    ``headers`` are as stored: plain text, or sealed with ``WEBHOOK_ENCRYPTION_KEY``
    (``fxenc:...``, opened by :meth:`secretbox.Keyring.open`, :func:`open_headers`).
    ``client_cert``: its own TLS client certificate (PEM chain), shown described only;
    ``client_key`` (its private key) never appears in :meth:`as_json` or ``repr``."""

    id: str
    tenant: str
    url: str
    event_types: tuple[str, ...]
    description: str = ""
    headers: Mapping[str, str] = field(default_factory=dict)
    rate_limit: int | None = None
    ordered: bool = False
    state: str = "enabled"
    disabled_reason: str | None = None
    disabled_at: datetime | None = None
    failing_since: datetime | None = None
    created_at: datetime | None = None
    updated_at: datetime | None = None
    secret: str | None = field(default=None, repr=False)
    secret_previous: str | None = field(default=None, repr=False)
    previous_until: datetime | None = None
    client_cert: str | None = field(default=None, repr=False)
    client_key: str | None = field(default=None, repr=False)

    @property
    def enabled(self) -> bool:
        return self.state == "enabled"

    @property
    def builtin(self) -> bool:
        return self.id in BUILTIN_IDS

    def as_json(self) -> dict[str, Any]:
        """The endpoint as the CLI and the API show it (never its secret, nor a custom
        header's credential: :func:`shown_headers`)."""
        return {
            "id": self.id,
            "tenant": None if self.tenant == OPERATOR_TENANT else self.tenant,
            "url": self.url,
            "event_types": list(self.event_types),
            "description": self.description,
            "headers": shown_headers(self.headers),
            "rate_limit": self.rate_limit,
            "ordered": self.ordered,
            "state": self.state,
            "disabled_reason": self.disabled_reason,
            "disabled_at": _iso(self.disabled_at),
            "failing_since": _iso(self.failing_since),
            "created_at": _iso(self.created_at),
            "updated_at": _iso(self.updated_at),
            "builtin": self.builtin,
            "client_certificate": self.client_certificate(),
            "previous_secret_until": _iso(self.previous_signs_until()),
        }

    def previous_signs_until(self) -> datetime | None:
        """Until when the secret before its last rotation still signs (a second
        ``webhook-signature``), or None: a consumer's deadline to move to the new one."""
        until = self.previous_until
        if self.secret_previous and until is not None and until > datetime.now(UTC):
            return until
        return None

    def client_certificate(self) -> dict[str, Any] | None:
        """Its own client certificate as shown: subject, issuer, expiry, SHA-256
        fingerprint (None: it has none, or a stored one that cannot be read). Never the
        certificate's key."""
        if not self.client_cert:
            return None
        described = clientcerts.describe(self.client_cert)
        return None if described is None else described.as_json()

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Endpoint:
        return cls(
            id=row["id"],
            tenant=row["tenant"],
            url=row["url"],
            event_types=tuple(row["event_types"]),
            description=row["description"],
            headers=_readable_headers(row["headers"]),
            rate_limit=row["rate_limit"],
            ordered=row["ordered"],
            state=row["state"],
            disabled_reason=row["disabled_reason"],
            disabled_at=row["disabled_at"],
            failing_since=row["failing_since"],
            created_at=row["created_at"],
            updated_at=row["updated_at"],
            secret=row["secret"],
            secret_previous=row["secret_previous"],
            previous_until=row["previous_until"],
            client_cert=row.get("client_cert"),
            client_key=row.get("client_key"),
        )


def _readable_headers(stored: Any) -> dict[str, str]:
    """A row's headers as text, whatever SQL wrote there (the CLI and the API write only
    text): a value of another JSON type as its JSON, anything but an object as none, so a
    list of endpoints is never broken by one row. The dispatcher checks the stored value
    itself and sends nothing to such an endpoint (targets)."""
    if not isinstance(stored, Mapping):
        return {}
    return {
        str(name): value if isinstance(value, str) else json.dumps(value)
        for name, value in stored.items()
    }


@dataclass(frozen=True)
class Changes:
    """An update: ``None`` leaves a field as it is (``rate_limit``: set ``clear_rate_limit``
    to go back to ``WEBHOOK_RETRY_RPS``)."""

    url: str | None = None
    event_types: Sequence[str] | None = None
    description: str | None = None
    headers: Mapping[str, str] | None = None
    rate_limit: int | None = None
    clear_rate_limit: bool = False
    ordered: bool | None = None


@dataclass(frozen=True)
class ClientCert:
    """An endpoint's own TLS client certificate as given: its PEM chain and private key,
    and the names their problems are said under (``--client-cert``, a JSON field...)."""

    chain: str = field(repr=False)
    key: str = field(repr=False)
    names: tuple[str, str] = ("certificate", "private_key")

    def check(self) -> clientcerts.Described:
        return clientcerts.check(
            self.chain, self.key, chain_name=self.names[0], key_name=self.names[1]
        )


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


# -- validation ---------------------------------------------------------------------------


def check_tenant(tenant: str, name: str = "tenant") -> str:
    """'' (the default tenant) or a name of letters, digits and ``._:@-``."""
    if not isinstance(tenant, str) or (tenant and not TENANT.fullmatch(tenant)):
        raise ConfigError(
            name, "must be empty (the default tenant) or 1-128 letters, digits and ._:@-"
        )
    return tenant


def check_tenant_filter(tenant: str | None, name: str = "--tenant") -> str | None:
    """A tenant to list by: as :func:`check_tenant`, or the operator's own (its dead
    letters); None lists every tenant. A typo is named rather than listing nothing."""
    if tenant is None or tenant == OPERATOR_TENANT:
        return tenant
    return check_tenant(tenant, name)


def check_url(url: str, *, allowed_networks: Sequence[IPNetwork] = (), name: str = "url") -> str:
    """The URL policy of SPEC section 7 for a registered endpoint: https (http to loopback
    only), no credentials, and no loopback or private address unless ``allowed_networks``
    (``WEBHOOK_ALLOWED_NETWORKS``) allows it. Host names are checked again when resolved."""
    if not isinstance(url, str) or not url.strip():
        raise ConfigError(name, "is required (the endpoint's https URL)")
    if len(url) > MAX_URL_LENGTH:
        raise ConfigError(name, f"must be at most {MAX_URL_LENGTH} characters (is {len(url)})")
    try:
        validate_kept_url(url)
        check_url_address(url, allowed_networks=allowed_networks, registered=True)
    except EndpointError as exc:
        raise ConfigError(name, str(exc)) from None
    return url


def check_event_type(value: str, name: str = "event_type") -> str:
    """An event's own type, as the API and ``send`` take it: what the ``x-fluxora-event``
    header carries as it is, 1 to 200 printable ASCII characters, not starting or ending
    with a space (enqueue's ``EVENT_TYPE``). (Endpoints' filters are narrower, but ``*`` and
    a prefix such as ``order.*`` take any type.)"""
    if not EVENT_TYPE.fullmatch(value):
        raise ConfigError(
            name,
            f"{value[:40]!r} is not an event type: 1 to 200 printable ASCII characters, not"
            " starting or ending with a space (it is sent as a header)",
        )
    return value


def check_event_types(patterns: Sequence[str], name: str = "event_types") -> tuple[str, ...]:
    """``*``, exact event types, or prefixes ending in ``*`` (``stream.*``)."""
    if isinstance(patterns, str) or not isinstance(patterns, Sequence):
        raise ConfigError(name, "must be a list of event types")
    if len(patterns) > 100:
        raise ConfigError(name, "may list at most 100 event types")
    texts: dict[str, None] = {}  # in order
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise ConfigError(name, f"holds {type(pattern).__name__} where an event type goes")
        text = pattern.strip()
        if not text:
            raise ConfigError(name, "holds an empty event type")
        if text in texts:
            raise ConfigError(name, f"lists {text[:40]!r} more than once")
        texts[text] = None
    if not texts:
        raise ConfigError(name, "must list at least one event type (or *)")
    found = tuple(texts)
    for pattern in found:
        if len(pattern.removesuffix("*")) > MAX_EVENT_TYPE:
            raise ConfigError(
                name,
                f"{pattern[:40]!r}... is {len(pattern)} characters: an event type (or a"
                f" prefix before its *) has at most {MAX_EVENT_TYPE}",
            )
        if not _EVENT_PATTERN.fullmatch(pattern):
            raise ConfigError(
                name,
                f"{pattern[:40]!r} is not an event type: printable ASCII without spaces, "
                "or a prefix ending in * such as stream.*",
            )
    return found


def check_headers(
    headers: Mapping[str, str], name: str = "headers", *, new: bool = False
) -> dict[str, str]:
    """Custom headers sent with every request; never one of ours or HTTP's own. ``new``:
    headers being registered (REFUSED_NEW_HEADERS too), not read from a stored row."""
    if not isinstance(headers, Mapping):
        raise ConfigError(name, "must map header names to values")
    if len(headers) > MAX_HEADERS:
        raise ConfigError(name, f"may hold at most {MAX_HEADERS} headers")
    out: dict[str, str] = {}
    for key, value in headers.items():
        if not isinstance(key, str) or not _HEADER_NAME.fullmatch(key):
            # Up to a space or a colon only: past them may be a credential.
            head, *rest = re.split(r"[\s:]", str(key), maxsplit=1)
            if rest:
                raise ConfigError(
                    name,
                    f"{head[:40] + '...'!r} is not a header name: a name holds no space or"
                    " colon (what follows one is not shown)",
                )
            raise ConfigError(name, f"{head[:40]!r} is not a header name")
        lower = key.lower()
        if lower in RESERVED_HEADERS or lower.startswith(RESERVED_HEADER_PREFIXES):
            raise ConfigError(name, f"{key} is set by fluxora-webhooks and cannot be overridden")
        if new and lower in REFUSED_NEW_HEADERS:
            raise ConfigError(
                name,
                f"{key} is for a connection's hop or the body's encoding, which HTTP itself"
                " decides; it cannot be sent as a custom header",
            )
        if lower in {k.lower() for k in out}:
            raise ConfigError(name, f"{key} is given twice")
        if not isinstance(value, str) or len(value) > 4096:
            raise ConfigError(name, f"the value of {key} must be text of at most 4096 characters")
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value) or not value.isascii():
            raise ConfigError(name, f"the value of {key} must be printable ASCII")
        if new and value.startswith(SEALED_PREFIX) and credential_header(key):
            raise ConfigError(
                name,
                f"the value of {key} must not start with {SEALED_PREFIX} (an encrypted"
                " value's form)",
            )
        out[key] = value
    total = sum(len(k) + len(v) + 4 for k, v in out.items())  # "Name: value\r\n"
    if new and total > MAX_HEADERS_BYTES:
        raise ConfigError(
            name,
            f"come to {total} bytes; at most {MAX_HEADERS_BYTES} in all (many servers refuse"
            " a request whose headers are larger, and every delivery would fail)",
        )
    return out


def check_rate_limit(value: int | None, name: str = "rate_limit") -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_RATE_LIMIT:
        raise ConfigError(name, f"must be a whole number from 1 to {MAX_RATE_LIMIT}")
    return value


def check_description(value: str, name: str = "description") -> str:
    if not isinstance(value, str) or len(value) > MAX_DESCRIPTION:
        raise ConfigError(name, f"must be text of at most {MAX_DESCRIPTION} characters")
    found = BIDI_CONTROLS.search(value)
    if found:
        raise ConfigError(
            name,
            f"contains a bidirectional control character (U+{ord(found.group()):04X}), which"
            " changes how the text around it is shown; remove it",
        )
    return value


def check_secret(value: str, name: str = "secret") -> str:
    """A signing secret: ``whsec_`` + base64 of 24-64 bytes, or any other text of 24+ bytes
    (used as written, as ``WEBHOOK_SECRET`` is)."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(name, "must not be empty")
    if value.startswith(SECRET_PREFIX):
        try:
            key = base64.b64decode(value[len(SECRET_PREFIX) :], validate=True)
        except (binascii.Error, ValueError):
            raise ConfigError(name, "starts with whsec_ but the rest is not valid base64") from None
        if not 24 <= len(key) <= 64:
            raise ConfigError(name, "a whsec_ secret must decode to 24-64 bytes")
    elif len(value.encode()) < 24 or len(value) > 512:
        raise ConfigError(name, "must be 24 to 512 characters (or whsec_ + base64)")
    # isprintable() is false for control characters and for every space but U+0020
    # (a no-break space, say), which no one can tell from a space when copying a secret.
    if not value.isprintable() or " " in value:
        raise ConfigError(name, "must be printable text without spaces")
    if value.startswith(SEALED_PREFIX):
        raise ConfigError(name, f"must not start with {SEALED_PREFIX} (an encrypted secret's form)")
    return value


def new_secret() -> str:
    """``whsec_`` + base64 of 32 random bytes, as Standard Webhooks recommends."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


def new_id() -> str:
    return "ep_" + base64.b32encode(secrets.token_bytes(15)).decode().lower()


def matches(patterns: Sequence[str], event_type: str) -> bool:
    """Whether an endpoint subscribed with ``patterns`` receives ``event_type`` (the same
    rule as the routing SQL)."""
    for pattern in patterns:
        if pattern == "*" or pattern == event_type:
            return True
        if pattern.endswith("*") and event_type.startswith(pattern[:-1]):
            return True
    return False


# -- the registry ---------------------------------------------------------------------------


def _scope(tenant: str | None) -> dict[str, Any]:
    return {"scoped": tenant is not None, "tenant": tenant if tenant is not None else ""}


async def _one(
    conn: psycopg.AsyncConnection[Any], name: str, params: Mapping[str, Any]
) -> dict[str, Any] | None:
    cur = conn.cursor(row_factory=dict_row)
    await cur.execute(query(name), params)
    return await cur.fetchone()


async def create(
    conn: psycopg.AsyncConnection[Any],
    *,
    url: str,
    tenant: str = "",
    event_types: Sequence[str] = ("*",),
    secret: str | None = None,
    description: str = "",
    headers: Mapping[str, str] | None = None,
    rate_limit: int | None = None,
    ordered: bool = False,
    allowed_networks: Sequence[IPNetwork] = (),
    max_for_tenant: int = 0,
    keys: Keyring | None = None,
    client_cert: ClientCert | None = None,
) -> tuple[Endpoint, str]:
    """Register an endpoint; returns it and its secret (generated unless given), which is
    shown this once. ``max_for_tenant`` (0: none): a tenant that has that many endpoints
    already gets :class:`EndpointLimitReached` (``WEBHOOK_MAX_ENDPOINTS_PER_TENANT``, for
    the creates of tenant tokens). The secret is stored sealed with ``keys`` (default: the
    process's ``WEBHOOK_ENCRYPTION_KEY``; none set: in plain text), and so are
    ``client_cert``'s private key (the endpoint's own TLS client certificate) and the
    values of the credential ``headers`` (:func:`seal_headers`)."""
    chosen = check_secret(secret) if secret is not None else new_secret()
    endpoint_id = new_id()
    keyring = keys or environ_keyring()
    sealed = keyring.seal(chosen, endpoint_id)
    if client_cert is not None:
        # In a thread: loading a key costs milliseconds of CPU (up to a third of a second
        # for RSA-4096) the API's event loop, every other request, must not wait.
        await asyncio.to_thread(client_cert.check)
    params = {
        "id": endpoint_id,
        "tenant": check_tenant(tenant),
        "url": check_url(url, allowed_networks=allowed_networks),
        "event_types": list(check_event_types(event_types)),
        "secret": sealed,
        "description": check_description(description),
        "headers": Jsonb(seal_headers(headers or {}, {}, endpoint_id, keyring)),
        "rate_limit": check_rate_limit(rate_limit),
        "ordered": bool(ordered),
        "client_cert": None if client_cert is None else client_cert.chain,
        "client_key": None if client_cert is None else keyring.seal(client_cert.key, endpoint_id),
    }
    if max_for_tenant <= 0:
        row = await _one(conn, "endpoint_insert", params)
    else:
        async with conn.transaction():
            await conn.execute(query("endpoint_tenant_lock"), {"tenant": params["tenant"]})
            counted = await _one(conn, "endpoint_tenant_count", {"tenant": params["tenant"]})
            assert counted is not None
            if counted["n"] >= max_for_tenant:
                raise EndpointLimitReached(
                    f"this tenant has {counted['n']} endpoints, the most it may have"
                    f" ({max_for_tenant}): remove one before adding another"
                )
            row = await _one(conn, "endpoint_insert", params)
    assert row is not None
    if not keyring.configured:
        await _warn_if_others_sealed(conn, endpoint_id)
    return Endpoint.from_row(row), chosen


async def _warn_if_others_sealed(conn: psycopg.AsyncConnection[Any], endpoint_id: str) -> None:
    """A process without the key adding an endpoint where secrets are stored encrypted
    (one the key was not given to) stores its secret in plain text: said, as a rotation by
    such a process says it (it was silent)."""
    cur = await conn.execute(
        "SELECT EXISTS (SELECT 1 FROM webhook_endpoints WHERE starts_with(secret, %s))",
        (SEALED_PREFIX,),
    )
    found = await cur.fetchone()
    if found and found[0]:
        log.warning(
            "endpoint %s: other endpoints' secrets are stored encrypted, but %s is not set"
            " here: its secret is stored in plain text (set the key on this process, then"
            " run `fluxora-webhooks secrets encrypt`)",
            endpoint_id,
            KEY_VARIABLE,
        )


async def get(
    conn: psycopg.AsyncConnection[Any], endpoint_id: str, *, tenant: str | None = None
) -> Endpoint:
    """The endpoint, or :class:`NotFoundError` (also for another tenant's)."""
    row = await _one(conn, "endpoint_get", {"id": endpoint_id, **_scope(tenant)})
    if row is None or (tenant is not None and row["tenant"] == OPERATOR_TENANT):
        raise NotFoundError(f"no endpoint {endpoint_id!r}")
    return Endpoint.from_row(row)


async def list_endpoints(
    conn: psycopg.AsyncConnection[Any],
    *,
    tenant: str | None = None,
    limit: int = 100,
    after: str | None = None,
) -> list[Endpoint]:
    """A page of endpoints ordered by id, after the cursor ``after``."""
    if not 1 <= limit <= MAX_PAGE:
        raise ConfigError("limit", f"must be from 1 to {MAX_PAGE}")
    cur = conn.cursor(row_factory=dict_row)
    await cur.execute(query("endpoint_list"), {"limit": limit, "after": after, **_scope(tenant)})
    return [Endpoint.from_row(r) for r in await cur.fetchall()]


async def update(
    conn: psycopg.AsyncConnection[Any],
    endpoint_id: str,
    changes: Changes,
    *,
    tenant: str | None = None,
    allowed_networks: Sequence[IPNetwork] = (),
    keys: Keyring | None = None,
) -> Endpoint:
    """Change what ``changes`` gives. New values of credential headers are stored sealed
    as :func:`create` stores them (``keys``, default: the process's); one given back as
    :data:`HIDDEN_HEADER_VALUE` stays as stored."""
    current = await get(conn, endpoint_id, tenant=tenant)
    if current.builtin:
        raise ConflictError(
            f"{endpoint_id} is configured from the environment; it cannot be updated"
        )
    params = {
        "id": endpoint_id,
        "url": None
        if changes.url is None
        else check_url(changes.url, allowed_networks=allowed_networks),
        "event_types": None
        if changes.event_types is None
        else list(check_event_types(changes.event_types)),
        "description": None
        if changes.description is None
        else check_description(changes.description),
        "headers": None
        if changes.headers is None
        else Jsonb(
            seal_headers(changes.headers, current.headers, endpoint_id, keys or environ_keyring())
        ),
        "set_rate_limit": changes.clear_rate_limit or changes.rate_limit is not None,
        "rate_limit": None if changes.clear_rate_limit else check_rate_limit(changes.rate_limit),
        "ordered": changes.ordered,
        **_scope(tenant),
    }
    async with conn.transaction():
        row = await _one(conn, "endpoint_update", params)
        if row is None:
            raise NotFoundError(f"no endpoint {endpoint_id!r}")
        if current.ordered and changes.ordered is False:
            await conn.execute(query("endpoint_release_waiting"), {"id": endpoint_id})
            await conn.execute(query("endpoint_unorder_pending"), {"id": endpoint_id})
    return Endpoint.from_row(row)


async def set_client_certificate(
    conn: psycopg.AsyncConnection[Any],
    endpoint_id: str,
    client_cert: ClientCert | None,
    *,
    tenant: str | None = None,
    keys: Keyring | None = None,
) -> Endpoint:
    """Give the endpoint its own TLS client certificate, presented to its consumer in
    place of ``WEBHOOK_TLS_CLIENT_CERT`` (a new one replaces the last: a rotation), or
    remove it (None: the deployment's certificate again, or none). The key is stored
    sealed as :func:`create` stores a secret. Running dispatchers use it at once."""
    current = await get(conn, endpoint_id, tenant=tenant)
    if current.builtin:
        raise ConflictError(
            f"{endpoint_id} is configured from the environment; its client certificate is"
            " WEBHOOK_TLS_CLIENT_CERT"
        )
    if client_cert is not None:
        await asyncio.to_thread(client_cert.check)  # as in create
    row = await _one(
        conn,
        "endpoint_client_cert_set",
        {
            "id": endpoint_id,
            "client_cert": None if client_cert is None else client_cert.chain,
            "client_key": None
            if client_cert is None
            else (keys or environ_keyring()).seal(client_cert.key, endpoint_id),
            **_scope(tenant),
        },
    )
    if row is None:
        raise NotFoundError(f"no endpoint {endpoint_id!r}")
    return Endpoint.from_row(row)


def keep_previous_ms(text: str, name: str = "keep_previous") -> int:
    """How long a rotated-out secret keeps signing, as the CLI, the API and the dashboard
    take it: ``0`` (it stops at once: after a leak) or a duration up to 30 days."""
    keep = text.strip()
    return 0 if keep == "0" else parse_duration_ms(keep, name, high_ms=MAX_KEEP_PREVIOUS_MS)


async def rotate_secret(
    conn: psycopg.AsyncConnection[Any],
    endpoint_id: str,
    *,
    secret: str | None = None,
    keep_previous_ms: int = DEFAULT_KEEP_PREVIOUS_MS,
    tenant: str | None = None,
    keys: Keyring | None = None,
) -> tuple[Endpoint, str]:
    """A new secret; the old one keeps signing (a second ``webhook-signature``) for
    ``keep_previous_ms``. Returns the endpoint and the new secret, shown this once. The
    new secret is stored sealed as :func:`create` stores one; the old one moves to
    ``secret_previous`` as it was stored (a sealed value is bound to the endpoint, not to
    its column), unless none of ``keys`` (configured) opens it: a lost key's secret could
    not sign, and kept a while it would hold the endpoint that while; it is dropped at once,
    whatever ``keep_previous_ms`` asked (``Endpoint.previous_until`` says so)."""
    current = await get(conn, endpoint_id, tenant=tenant)
    if current.builtin:
        if endpoint_id == DEFAULT_ID:
            how = "set the new one in WEBHOOK_SECRET and the old one in WEBHOOK_SECRET_PREVIOUS"
        else:
            how = "set the new one in WEBHOOK_OPERATOR_SECRET (it keeps no previous secret)"
        raise ConflictError(
            f"{endpoint_id} signs with a secret from the environment; rotate it there: {how}"
        )
    if not 0 <= keep_previous_ms <= MAX_KEEP_PREVIOUS_MS:
        raise ConfigError("keep_previous", "must be from 0 to 30 days")
    chosen = check_secret(secret) if secret is not None else new_secret()
    keyring = keys or environ_keyring()
    locked = unopenable(current.secret, endpoint_id, keyring) if keyring.configured else None
    if locked is not None and keep_previous_ms > 0:
        # This process cannot open the current secret: the key is lost, or this process
        # (an operator's shell, one API replica) has another one than the dispatchers. The
        # latter would drop a secret that still signs and seal the new one with a key the
        # dispatchers lack; only a rotation that keeps nothing says it is the former.
        raise ConflictError(
            f"{locked}: rotate from a process with that key (the dispatchers'), or, when the"
            " key is lost, keep no previous secret (keep_previous 0): it could not sign"
        )
    row = await _one(
        conn,
        "endpoint_rotate",
        {
            "id": endpoint_id,
            "secret": keyring.seal(chosen, endpoint_id, replacing=current.secret),
            "keep_ms": keep_previous_ms,
            # A lost key's secret replaced at once (docs/security.md): not kept as the
            # previous one, where it would hold the endpoint (it cannot sign) and
            # `secrets encrypt|decrypt` would still find it unreadable.
            "drop_previous": locked is not None,
            **_scope(tenant),
        },
    )
    if row is None:
        raise NotFoundError(f"no endpoint {endpoint_id!r}")
    return Endpoint.from_row(row), chosen


RESEAL_BATCH = 500


@dataclass
class Resealed:
    """What :func:`reseal_secrets` did, counted in stored secrets (an endpoint's current
    and previous one, its client certificate's key and the value of each of its credential
    headers, :func:`credential_header`, each count): ``changed`` sealed with
    the current key (or opened, when decrypting), of which ``rekeyed`` were sealed with
    another key before; ``unchanged`` already in the wanted form (and opened by it);
    ``unreadable``: sealed values none of this process's keys opens, left as they are:
    (endpoint id, key id, which value: ``its secret``, ``its previous secret``, ``its
    client certificate's private key``, ``the value of its header NAME``, and why, a
    sentence that begins with which value it is: sealed with a key this process does not
    have, or with its key and altered or copied from another endpoint)."""

    changed: int = 0
    rekeyed: int = 0
    unchanged: int = 0
    unreadable: list[tuple[str, str, str, str]] = field(default_factory=list)


def _which_value(column: str | tuple[str, str]) -> str:
    """A stored value's name as the ``secrets`` command says it (:class:`Resealed`)."""
    if isinstance(column, tuple):
        return f"the value of its header {column[1]}"
    return {
        "secret": "its secret",
        "secret_previous": "its previous secret",
        "client_key": "its client certificate's private key",
    }.get(column, column)


async def reseal_secrets(
    conn: psycopg.AsyncConnection[Any],
    keys: Keyring,
    *,
    plain: bool = False,
    batch: int = RESEAL_BATCH,
) -> Resealed:
    """Store every endpoint's secrets (signing secrets, client certificates' private keys,
    the values of credential headers) sealed with the current key of ``keys`` (plain ones
    and those of the previous key; ``plain``: opened, as before a key was set), ``batch``
    endpoints per transaction. Idempotent: a secret in the wanted form is left alone."""
    from .secretbox import is_sealed, sealed_key_id

    if not plain and keys.current is None:
        raise ConfigError("WEBHOOK_ENCRYPTION_KEY", "is required to encrypt the secrets")
    done = Resealed()
    after = ""
    while True:
        async with conn.transaction():
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(query("endpoint_secrets_page"), {"after": after, "limit": batch})
            rows = await cur.fetchall()
            for row in rows:
                endpoint_id = str(row["id"])
                stored: dict[str | tuple[str, str], Any] = {
                    k: row[k] for k in ("secret", "secret_previous", "client_key")
                }
                headers = row["headers"] if isinstance(row["headers"], Mapping) else {}
                # Each credential header's value, under its name (a header is no column).
                for name, value in headers.items():
                    if isinstance(value, str) and value and credential_header(str(name)):
                        stored[("headers", str(name))] = value
                wanted = dict(stored)
                for column, value in stored.items():
                    if value is None:
                        continue
                    if plain and not is_sealed(value):
                        done.unchanged += 1
                        continue
                    which = _which_value(column)
                    try:
                        # A value sealed with the current key is opened too: one altered,
                        # or copied from another endpoint (its id is sealed in), cannot be
                        # sent with, and is not "encrypted already".
                        opened = keys.open(value, endpoint_id, which)
                    except SecretLocked as exc:
                        done.unreadable.append((endpoint_id, exc.key_id, which, str(exc)))
                        continue
                    if not plain and keys.sealed_with_current(value):
                        done.unchanged += 1
                        continue
                    wanted[column] = opened if plain else keys.seal(opened, endpoint_id)
                    done.changed += 1
                    if not plain and sealed_key_id(value) is not None:
                        done.rekeyed += 1
                if wanted != stored:
                    params: dict[str, Any] = {"id": endpoint_id, "headers": Jsonb(row["headers"])}
                    new_headers = dict(headers)
                    for column, value in wanted.items():
                        if isinstance(column, tuple):
                            new_headers[column[1]] = value
                            params["headers"] = Jsonb(new_headers)
                        else:
                            params[column] = value
                    await conn.execute(query("endpoint_secrets_set"), params)
        if len(rows) < batch:
            return done
        after = str(rows[-1]["id"])


async def disable(
    conn: psycopg.AsyncConnection[Any],
    endpoint_id: str,
    *,
    reason: str = "manual",
    tenant: str | None = None,
) -> Endpoint:
    """Disable the endpoint and park its pending deliveries (kept, not attempted); the
    operator is told (``endpoint.disabled``). Disabling a disabled endpoint parks what is
    pending and not parked yet (a retry its completion inserted while it saw the endpoint
    enabled, two 410s at once, say), and changes nothing else."""
    endpoint, _ = await disable_once(conn, endpoint_id, reason=reason, tenant=tenant)
    return endpoint


async def disable_once(
    conn: psycopg.AsyncConnection[Any],
    endpoint_id: str,
    *,
    reason: str = "manual",
    tenant: str | None = None,
) -> tuple[Endpoint, bool]:
    """:func:`disable`, and whether this call disabled it (False: it was disabled
    already, by another process's 410 at the same moment, say)."""
    if reason not in DISABLED_REASONS:
        raise ConfigError("reason", f"must be one of {', '.join(DISABLED_REASONS)}")
    current = await get(conn, endpoint_id, tenant=tenant)
    if current.id == OPERATOR_ID:
        raise ConflictError("the operator endpoint is never disabled")
    async with conn.transaction():
        row = await _one(
            conn, "endpoint_disable", {"id": endpoint_id, "reason": reason, **_scope(tenant)}
        )
        await conn.execute(query("endpoint_park"), {"id": endpoint_id})
        if row is None:
            return await get(conn, endpoint_id, tenant=tenant), False  # already disabled
        await operator_event(
            conn, "endpoint.disabled", stream_id=endpoint_id, payload=_state_event(row, reason)
        )
    return Endpoint.from_row(row), True


async def enable(
    conn: psycopg.AsyncConnection[Any], endpoint_id: str, *, tenant: str | None = None
) -> Endpoint:
    """Enable the endpoint: every parked delivery is due again (an ordered stream's in
    order), its failure streak starts afresh, and the operator is told."""
    endpoint, _ = await enable_once(conn, endpoint_id, tenant=tenant)
    return endpoint


async def enable_once(
    conn: psycopg.AsyncConnection[Any], endpoint_id: str, *, tenant: str | None = None
) -> tuple[Endpoint, bool]:
    """:func:`enable`, and whether this call enabled it (False: it was enabled already)."""
    from .outbox import promote_after_commit

    async with conn.transaction():
        row = await _one(conn, "endpoint_enable", {"id": endpoint_id, **_scope(tenant)})
        if row is None:
            return await get(conn, endpoint_id, tenant=tenant), False  # enabled, or 404
        streams = await _unpark(conn, endpoint_id)
        await operator_event(
            conn, "endpoint.enabled", stream_id=endpoint_id, payload=_state_event(row, None)
        )
    # After the commit: no transaction waits for a stream's lock holding anything else
    # (docs/design.md, "Ordering"); should this fail, the sweep chooses the heads.
    await promote_after_commit(conn, [(endpoint_id, s) for s in streams])
    return Endpoint.from_row(row), True


# How long after an endpoint's last change the sweep looks for deliveries parked on it
# while it is enabled (endpoint_stragglers): far longer than any transaction that parks.
STRAGGLER_WINDOW_S = 600.0


async def unpark_stragglers(conn: psycopg.AsyncConnection[Any]) -> int:
    """Deliveries parked on an endpoint enabled meanwhile (a transaction that read it
    disabled committed after the enable's unpark): due again, as the enable made the
    others (an ordered stream's in order). Returns how many endpoints had any."""
    from .outbox import promote_heads

    cur = await conn.execute(
        query("endpoint_stragglers"), {"window_ms": int(STRAGGLER_WINDOW_S * 1000)}
    )
    found = [str(r[0]) for r in await cur.fetchall()]
    for endpoint_id in found:
        async with conn.transaction():
            streams = await _unpark(conn, endpoint_id)
        await promote_heads(conn, [(endpoint_id, s) for s in streams])
    return len(found)


async def _unpark(conn: psycopg.AsyncConnection[Any], endpoint_id: str) -> list[str]:
    """Every parked delivery of the endpoint due again (endpoint_unpark); the ordered
    streams whose next head is to be chosen once the transaction has committed."""
    cur = await conn.execute(
        query("endpoint_unpark"), {"id": endpoint_id, "rps": retry_rps(os.environ)}
    )
    return [str(r[0]) for r in await cur.fetchall()]


async def remove(
    conn: psycopg.AsyncConnection[Any], endpoint_id: str, *, tenant: str | None = None
) -> int:
    """Remove the endpoint. Its pending deliveries become dead letters (reason
    ``endpoint_removed``) in the same transaction; returns how many."""
    current = await get(conn, endpoint_id, tenant=tenant)
    if current.builtin:
        raise ConflictError(
            f"{endpoint_id} is configured from the environment; it cannot be removed"
        )
    async with conn.transaction():
        cur = await conn.execute(query("endpoint_remove"), {"id": endpoint_id, **_scope(tenant)})
        row = await cur.fetchone()
    assert row is not None
    if not row[0]:
        raise NotFoundError(f"no endpoint {endpoint_id!r}")
    return int(row[1])


RECOVER_BATCH = 1000


async def moment(conn: psycopg.AsyncConnection[Any], text: str, name: str) -> datetime:
    """A point in time given as ISO 8601 (UTC unless it says otherwise) or as a duration
    ago (``2h``, on the database's clock)."""
    value = (text or "").strip()
    if not value:
        raise ConfigError(name, "is empty; give an ISO 8601 time or a duration ago such as 2h")
    try:
        when = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        if not looks_like_duration(value):
            raise ConfigError(
                name, f"{value[:40]!r} is neither an ISO 8601 time nor a duration such as 2h"
            ) from None
        ago_ms = parse_duration_ms(value, name)  # a duration too long says so
        cur = await conn.execute("SELECT now() - %s * interval '1 millisecond'", (ago_ms,))
        row = await cur.fetchone()
        assert row is not None
        moment_: datetime = row[0]
        return moment_
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


async def recover(
    conn: psycopg.AsyncConnection[Any],
    endpoint_id: str,
    *,
    since: datetime,
    until: datetime | None = None,
    tenant: str | None = None,
    batch: int = RECOVER_BATCH,
) -> int:
    """Put every dead letter of the endpoint from ``[since, until)`` (until: now) back into
    the outbox (same delivery id, attempts counted afresh), ``batch`` per transaction, with
    no cap on the total, due one after another at the endpoint's retry rate (its
    ``rate_limit``, else ``WEBHOOK_RETRY_RPS``), the first at once. Returns how many."""
    from .outbox import promote_after_commit

    await get(conn, endpoint_id, tenant=tenant)
    if until is None:
        cur = await conn.execute("SELECT clock_timestamp()")
        row = await cur.fetchone()
        assert row is not None
        if row[0] <= since:  # no until given: the window ends now
            raise ConfigError("since", "is in the future (the window ends now)")
        until = row[0]
    assert until is not None
    if until <= since:
        raise ConfigError("until", "must be later than since")
    total, rps = 0, retry_rps(os.environ)
    while True:
        async with conn.transaction():
            cur = await conn.execute(
                query("recover_dead_letters"),
                {
                    "endpoint_id": endpoint_id,
                    "since": since,
                    "until": until,
                    "batch": batch,
                    "start": total,
                    "rps": rps,
                },
            )
            row = await cur.fetchone()
            assert row is not None
            count, streams = int(row[0]), list(row[1] or [])
        await promote_after_commit(conn, [(endpoint_id, s) for s in streams])
        total += count
        if count < batch:
            return total


async def operator_event(
    conn: psycopg.AsyncConnection[Any], event_type: str, *, stream_id: str, payload: Any
) -> str | None:
    """Enqueue an operator event when the operator endpoint is configured (its delivery
    id), else nothing (None)."""
    cur = await conn.execute(
        query("operator_event"),
        {"event_type": event_type, "stream_id": stream_id, "payload": Jsonb(payload)},
    )
    row = await cur.fetchone()
    return None if row is None else str(row[0])


def _state_event(row: Mapping[str, Any], reason: str | None) -> dict[str, Any]:
    return {
        "endpoint_id": row["id"],
        "tenant": row["tenant"],
        "reason": reason,
        "state": row["state"],
        "at": _iso(row["updated_at"]),
        # When the failure streak that disabled it began (null: none, as after an enable).
        "failing_since": _iso(row["failing_since"]),
    }


async def sync_builtin(
    conn: psycopg.AsyncConnection[Any], endpoint_id: str, url: str | None
) -> bool:
    """Record a built-in endpoint as this service configures it: present with its URL (and
    this dispatcher seen configuring it), or, when its variable is unset, removed if no
    dispatcher has configured it for BUILTIN_SEEN_S (a host missing the variable beside
    hosts that have it leaves it alone; see :func:`retire_builtin`). Its disabled state
    survives a restart: a disabled built-in endpoint is not removed (its deliveries stay
    parked until it is enabled). Returns whether it was removed."""
    tenant = _builtin_tenant(endpoint_id)
    if url:
        await conn.execute(
            query("builtin_upsert"), {"id": endpoint_id, "tenant": tenant, "url": url}
        )
        await seen_builtin(conn, endpoint_id)
        return False
    return await retire_builtin(conn, endpoint_id)


async def seen_builtin(conn: psycopg.AsyncConnection[Any], endpoint_id: str) -> None:
    """This dispatcher configures the built-in endpoint (every HOUSEKEEPING_S)."""
    await conn.execute(query("builtin_seen"), {"id": endpoint_id})


async def retire_builtin(conn: psycopg.AsyncConnection[Any], endpoint_id: str) -> bool:
    """Remove the built-in endpoint if no running dispatcher has configured it for
    BUILTIN_SEEN_S (its variable is gone from every host); True if it was removed. Its
    pending deliveries stay: they wait for a dispatcher that configures it again."""
    cur = await conn.execute(query("builtin_retire"), {"id": endpoint_id, "seen_s": BUILTIN_SEEN_S})
    return await cur.fetchone() is not None


async def restore_builtin(conn: psycopg.AsyncConnection[Any], endpoint_id: str, url: str) -> bool:
    """Put a configured built-in endpoint back if it is missing (a dispatcher started
    without its variable removed it); True if it was. A present one is left as it is."""
    cur = await conn.execute(
        query("builtin_restore"),
        {"id": endpoint_id, "tenant": _builtin_tenant(endpoint_id), "url": url},
    )
    return await cur.fetchone() is not None


def _builtin_tenant(endpoint_id: str) -> str:
    if endpoint_id not in BUILTIN_IDS:
        raise ValueError(f"{endpoint_id} is not a built-in endpoint")
    return OPERATOR_TENANT if endpoint_id == OPERATOR_ID else ""
