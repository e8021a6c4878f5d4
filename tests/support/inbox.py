"""Signed requests for the consumer's inbox tests, made by the dispatcher's own Signer."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fluxora_webhooks.signing import Signer
from tests.support.dispatch import SECRET


@dataclass(frozen=True)
class Delivery:
    """One attempt of one event, as the dispatcher would send it."""

    delivery_id: str
    body: bytes
    headers: dict[str, str]

    def standard_only(self) -> dict[str, str]:
        return {k: v for k, v in self.headers.items() if not k.startswith("x-fluxora-")}

    def fluxora_only(self) -> dict[str, str]:
        return {k: v for k, v in self.headers.items() if not k.startswith("webhook-")}

    def raw_pairs(self) -> list[tuple[bytes, bytes]]:
        """The headers as an ASGI scope carries them."""
        return [(k.encode(), v.encode()) for k, v in self.headers.items()]


def delivery(
    payload: Any = None,
    *,
    delivery_id: str | None = None,
    secret: bytes = SECRET,
    previous: bytes | None = None,
    timestamp: int | None = None,
    attempt: int = 1,
    event_type: str = "account.credited",
    body: bytes | None = None,
) -> Delivery:
    delivery_id = delivery_id or str(uuid.uuid4())
    if body is None:
        body = json.dumps({"amount": 1} if payload is None else payload).encode()
    headers = Signer(secret, previous).headers(
        delivery_id=delivery_id,
        event_type=event_type,
        attempt=attempt,
        body=body,
        timestamp=int(time.time()) if timestamp is None else timestamp,
    )
    return Delivery(delivery_id, body, headers)
