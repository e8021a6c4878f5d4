"""Signing (producer side) and verification (consumer side).

Two schemes are sent on every request:

- ``x-fluxora-signature``: lowercase hex HMAC-SHA256 over ``"<timestamp>." + body``, keyed
  with the bytes of ``WEBHOOK_SECRET`` as written (the original wire format).
- Standard Webhooks: ``webhook-signature: v1,<base64>`` over ``"<id>.<timestamp>.<body>"``,
  keyed with the base64-decoded part of a ``whsec_`` secret, otherwise the secret's bytes.

:func:`verify` checks either scheme on the consumer side. It prefers Standard Webhooks when
``webhook-signature`` is present, because that scheme also signs the delivery id; the
x-fluxora scheme does not, so a captured request could be replayed with a different
``x-fluxora-delivery-id`` within the timestamp tolerance. :func:`verify_request` is the same
check returning what it read as well; the consumer's inbox (:mod:`fluxora_webhooks.inbox`)
verifies with it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass

from ._version import __version__
from .errors import VerificationError

USER_AGENT = f"fluxora-webhooks/{__version__}"

DEFAULT_TOLERANCE_SECONDS = 300

# Unix seconds as ASCII digits only: int() alone would also take "+5", " 5", "1_0" and
# non-ASCII digits. Sixteen digits is far beyond any real clock and bounds the work.
_TIMESTAMP = re.compile(r"[0-9]{1,16}", re.ASCII)
_HEX_DIGEST = re.compile(r"[0-9a-fA-F]{64}", re.ASCII)
# One Standard Webhooks entry: "v1," and the base64 of a 32-byte digest (44 characters).
_MAX_SIGNATURE_ENTRIES = 16


def standard_key(secret: bytes) -> bytes:
    """The Standard Webhooks HMAC key for a configured secret."""
    key = _whsec_key(secret)
    return secret if key is None else key


def _whsec_key(secret: bytes) -> bytes | None:
    """The key of a ``whsec_`` secret decoded as the sender decodes it (strict base64,
    padded); None unless it is ``whsec_`` followed by valid base64."""
    if not secret.startswith(b"whsec_"):
        return None
    try:
        return base64.b64decode(secret[len(b"whsec_") :], validate=True)
    except (binascii.Error, ValueError):
        return None


class Signer:
    """Builds the signed headers of one attempt. Keys are prepared once."""

    def __init__(self, secret: bytes, previous: bytes | None = None) -> None:
        for name, value in (("secret", secret), ("previous", previous)):
            if value is not None and not (value and standard_key(value)):
                # Either scheme would be an HMAC with an empty key: anyone could sign.
                raise ValueError(f"the {name} signing secret is empty (once decoded)")
        self._fluxora = hmac.new(secret, digestmod=hashlib.sha256)
        self._standard = [hmac.new(standard_key(secret), digestmod=hashlib.sha256)]
        if previous is not None:
            self._standard.append(hmac.new(standard_key(previous), digestmod=hashlib.sha256))

    @property
    def secrets(self) -> int:
        """How many secrets sign each attempt's webhook-signature (2 during a rotation's
        overlap)."""
        return len(self._standard)

    def headers(
        self, *, delivery_id: str, event_type: str, attempt: int, body: bytes, timestamp: int
    ) -> dict[str, str]:
        ts_text = str(timestamp)
        ts = ts_text.encode()
        # Feed the prefix and the body separately: no copy of a large body per signature.
        fx = self._fluxora.copy()
        fx.update(ts + b".")
        fx.update(body)
        prefix = delivery_id.encode() + b"." + ts + b"."
        sigs = []
        for key in self._standard:
            mac = key.copy()
            mac.update(prefix)
            mac.update(body)
            sigs.append("v1," + base64.b64encode(mac.digest()).decode())
        return {
            "content-type": "application/json",
            "user-agent": USER_AGENT,
            "x-fluxora-delivery-id": delivery_id,
            "x-fluxora-event": event_type,
            "x-fluxora-timestamp": ts_text,
            "x-fluxora-signature": fx.hexdigest(),
            "x-fluxora-attempt": str(attempt),
            "webhook-id": delivery_id,
            "webhook-timestamp": ts_text,
            "webhook-signature": " ".join(sigs),
        }


def _finite_seconds(value: object) -> bool:
    """Whether ``value`` is a finite number (an int, a float, a Decimal, numpy's), not a
    bool or a text that float() would read."""
    if isinstance(value, bool | str | bytes | bytearray):
        return False
    try:
        return math.isfinite(float(value))  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return False


def verify(
    body: bytes,
    headers: Mapping[str, str],
    secret: str | bytes,
    *,
    previous: str | bytes | None = None,
    tolerance: int = DEFAULT_TOLERANCE_SECONDS,
    now: float | None = None,
    scheme: str = "auto",
) -> str:
    """Verify a received webhook and return its delivery id (use it to de-duplicate).

    ``body`` is the raw request body, exactly as received. ``headers`` is any mapping of the
    request's headers; names are matched case-insensitively. If ``webhook-signature`` is
    present the Standard Webhooks scheme is checked (``webhook-id``, ``webhook-timestamp``,
    ``webhook-signature``), otherwise the x-fluxora scheme (``x-fluxora-delivery-id``,
    ``x-fluxora-timestamp``, ``x-fluxora-signature``).

    ``secret`` is the configured ``WEBHOOK_SECRET``; ``previous`` a second accepted secret
    during a rotation. A timestamp more than ``tolerance`` seconds away from ``now``
    (default: the current time) is refused, in the past as in the future.

    ``scheme`` is ``"auto"`` (above), ``"standard"`` or ``"fluxora"`` to require one scheme.
    The x-fluxora signature does not cover the delivery id, so a consumer that de-duplicates
    and wants that id signed too should pass ``scheme="standard"``.

    Anything the request carries can only raise :class:`VerificationError`, whose ``reason``
    names the failed check; messages never contain a secret. A caller's own mistake (an empty
    secret, a ``whsec_`` secret that is not valid base64, a body that is not bytes) raises
    ``TypeError`` or ``ValueError`` instead.
    """
    return verify_request(
        body, headers, secret, previous=previous, tolerance=tolerance, now=now, scheme=scheme
    ).delivery_id


@dataclass(frozen=True, slots=True)
class Verified:
    """What :func:`verify_request` checked: the delivery id, the scheme whose signature
    matched (``"standard"`` or ``"fluxora"``) and the request's headers as read for the
    check (names lowercased, first occurrence, a non-text value as None)."""

    delivery_id: str
    scheme: str
    headers: Mapping[str, str | None]


def verify_request(
    body: bytes,
    headers: Mapping[str, str],
    secret: str | bytes,
    *,
    previous: str | bytes | None = None,
    tolerance: int = DEFAULT_TOLERANCE_SECONDS,
    now: float | None = None,
    scheme: str = "auto",
) -> Verified:
    """:func:`verify`, returning what it read besides the delivery id (the inbox needs the
    unsigned ``x-fluxora-event`` and ``x-fluxora-attempt`` of the same request)."""
    keys = _keys(secret, previous)
    if not isinstance(body, bytes | bytearray | memoryview):
        raise TypeError("body must be the raw request body as bytes")
    if isinstance(tolerance, bool) or not isinstance(tolerance, int) or tolerance < 0:
        raise ValueError("tolerance must be a whole number of seconds, 0 or more")
    if scheme not in ("auto", "standard", "fluxora"):
        raise ValueError("scheme must be 'auto', 'standard' or 'fluxora'")
    if now is not None and not _finite_seconds(now):
        raise ValueError("now must be a finite number of unix seconds (or None: the clock)")
    found = _lowercase_headers(headers)
    current = time.time() if now is None else now
    if scheme == "standard" or (scheme == "auto" and "webhook-signature" in found):
        return Verified(_verify_standard(body, found, keys, tolerance, current), "standard", found)
    return Verified(_verify_fluxora(body, found, keys, tolerance, current), "fluxora", found)


def _keys(secret: str | bytes, previous: str | bytes | None) -> list[bytes]:
    keys = [_secret_bytes(secret, "secret")]
    if previous is not None:
        keys.append(_secret_bytes(previous, "previous"))
    return keys


def _secret_bytes(value: str | bytes, name: str) -> bytes:
    if isinstance(value, str):
        value = value.encode("utf-8")
    if not isinstance(value, bytes):
        raise TypeError(f"{name} must be str or bytes")
    if not value:
        raise ValueError(f"{name} must not be empty")
    if value.startswith(b"whsec_"):
        key = _whsec_key(value)
        if key is None:
            # The sender refuses it (run, endpoints add): used as raw bytes here, it would
            # match no signature, and other libraries decode it as yet another key.
            raise ValueError(
                f"{name} starts with whsec_ but the rest is not valid base64 (Standard "
                "Webhooks): copy it whole, with any = padding at its end"
            )
        if not key:
            # "whsec_" alone: the Standard Webhooks key would be empty, so anyone could sign.
            raise ValueError(f"{name} is whsec_ with no key after it")
    return value


def _lowercase_headers(headers: Mapping[str, str]) -> dict[str, str | None]:
    """Header names lowercased. A value that is not text maps to None (treated as invalid).

    The first occurrence of a repeated header wins (multidicts yield every occurrence); the
    signature covers what is used, so a second copy cannot make a forged request pass.
    """
    try:
        items = list(headers.items())
    except Exception:  # any object that is not a mapping: the request is unusable
        raise VerificationError("missing_header", "the headers are not a mapping") from None
    found: dict[str, str | None] = {}
    for item in items:
        try:
            name, value = item
        except (TypeError, ValueError):
            continue
        key = _text(name)
        if key is None:
            continue
        found.setdefault(key.lower(), _text(value))
    return found


def _text(value: object) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, bytes | bytearray):
        # Raw header bytes (ASGI, for example): decode reversibly, as aiohttp does.
        return bytes(value).decode("utf-8", "surrogateescape")
    return None


def _required(found: Mapping[str, str | None], name: str) -> str:
    value = found.get(name)
    if value is None or not value.strip():
        raise VerificationError("missing_header", f"the {name} header is missing or empty")
    return value.strip()


def _check_timestamp(text: str, name: str, tolerance: int, now: float) -> None:
    if not _TIMESTAMP.fullmatch(text):
        raise VerificationError("bad_timestamp", f"{name} is not a unix time in seconds")
    timestamp = int(text)
    if timestamp < now - tolerance:
        raise VerificationError(
            "timestamp_too_old", f"{name} is more than {tolerance}s in the past"
        )
    if timestamp > now + tolerance:
        raise VerificationError(
            "timestamp_too_new", f"{name} is more than {tolerance}s in the future"
        )


def _encode(text: str) -> bytes | None:
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return None


def _verify_standard(
    body: bytes | bytearray | memoryview,
    found: Mapping[str, str | None],
    keys: list[bytes],
    tolerance: int,
    now: float,
) -> str:
    if "webhook-signature" not in found:
        raise VerificationError("missing_header", "the webhook-signature header is missing")
    signature_header = found["webhook-signature"]
    if signature_header is None:
        raise VerificationError("bad_signature", "webhook-signature is not text")
    if not signature_header.strip():  # as for every other required header
        raise VerificationError(
            "missing_header", "the webhook-signature header is missing or empty"
        )
    delivery_id = _required(found, "webhook-id")
    ts = _required(found, "webhook-timestamp")
    _check_timestamp(ts, "webhook-timestamp", tolerance, now)
    received = []
    for entry in signature_header.split()[:_MAX_SIGNATURE_ENTRIES]:
        version, sep, encoded = entry.partition(",")
        if version != "v1" or not sep:
            continue  # another version of the scheme: not ours to check
        try:
            digest = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            continue
        if len(digest) == hashlib.sha256().digest_size:
            received.append(digest)
    if not received:
        raise VerificationError("bad_signature", "webhook-signature has no v1 signature")
    id_bytes = _encode(delivery_id)
    if id_bytes is not None:
        prefix = id_bytes + b"." + ts.encode("ascii") + b"."
        for key in keys:
            mac = hmac.new(standard_key(key), prefix, hashlib.sha256)
            mac.update(body)
            expected = mac.digest()
            for digest in received:
                if hmac.compare_digest(expected, digest):
                    return delivery_id
    raise VerificationError(
        "no_matching_signature", "no webhook-signature entry matches the body and the secret"
    )


def _verify_fluxora(
    body: bytes | bytearray | memoryview,
    found: Mapping[str, str | None],
    keys: list[bytes],
    tolerance: int,
    now: float,
) -> str:
    if "x-fluxora-signature" not in found:
        raise VerificationError(
            "missing_header", "neither webhook-signature nor x-fluxora-signature is present"
        )
    signature = _required(found, "x-fluxora-signature")
    ts = _required(found, "x-fluxora-timestamp")
    delivery_id = _required(found, "x-fluxora-delivery-id")
    _check_timestamp(ts, "x-fluxora-timestamp", tolerance, now)
    if not _HEX_DIGEST.fullmatch(signature):
        raise VerificationError(
            "bad_signature", "x-fluxora-signature is not a hex HMAC-SHA256 digest"
        )
    received = bytes.fromhex(signature)
    message_prefix = ts.encode("ascii") + b"."
    for key in keys:
        mac = hmac.new(key, message_prefix, hashlib.sha256)
        mac.update(body)
        if hmac.compare_digest(mac.digest(), received):
            return delivery_id
    raise VerificationError(
        "no_matching_signature", "x-fluxora-signature does not match the body and the secret"
    )
