"""Signing (producer side) and verification (consumer side).

Two schemes are sent on every request:

- ``x-fluxora-signature``: lowercase hex HMAC-SHA256 over ``"<timestamp>." + body``, keyed
  with the bytes of ``WEBHOOK_SECRET`` as written (the original wire format).
- Standard Webhooks: ``webhook-signature: v1,<base64>`` over ``"<id>.<timestamp>.<body>"``,
  keyed with the base64-decoded part of a ``whsec_`` secret, otherwise the secret's bytes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac

from . import __version__

USER_AGENT = f"fluxora-webhooks/{__version__}"


def standard_key(secret: bytes) -> bytes:
    """The Standard Webhooks HMAC key for a configured secret."""
    if secret.startswith(b"whsec_"):
        try:
            return base64.b64decode(secret[len(b"whsec_") :], validate=True)
        except (binascii.Error, ValueError):
            return secret
    return secret


class Signer:
    """Builds the signed headers of one attempt. Keys are prepared once."""

    def __init__(self, secret: bytes, previous: bytes | None = None) -> None:
        self._fluxora = hmac.new(secret, digestmod=hashlib.sha256)
        self._standard = [hmac.new(standard_key(secret), digestmod=hashlib.sha256)]
        if previous is not None:
            self._standard.append(hmac.new(standard_key(previous), digestmod=hashlib.sha256))

    def headers(
        self, *, delivery_id: str, event_type: str, attempt: int, body: bytes, timestamp: int
    ) -> dict[str, str]:
        ts = str(timestamp).encode()
        fx = self._fluxora.copy()
        fx.update(ts + b"." + body)
        signed = delivery_id.encode() + b"." + ts + b"." + body
        sigs = []
        for key in self._standard:
            mac = key.copy()
            mac.update(signed)
            sigs.append("v1," + base64.b64encode(mac.digest()).decode())
        return {
            "content-type": "application/json",
            "user-agent": USER_AGENT,
            "x-fluxora-delivery-id": delivery_id,
            "x-fluxora-event": event_type,
            "x-fluxora-timestamp": str(timestamp),
            "x-fluxora-signature": fx.hexdigest(),
            "x-fluxora-attempt": str(attempt),
            "webhook-id": delivery_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": " ".join(sigs),
        }
