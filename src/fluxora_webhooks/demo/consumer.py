"""The demo's consumer: an HTTP server on loopback that behaves as a careful consumer should.

- Every request is verified with :func:`fluxora_webhooks.signing.verify`, once per scheme
  (Standard Webhooks, then the original ``x-fluxora-signature``), and with the
  ``standardwebhooks`` package when it is installed. A request that fails any check is
  answered 401 and counted as a signature failure.
- Deliveries are de-duplicated by delivery id: a second copy of an accepted delivery is a
  duplicate (answered 200, so the sender stops).
- The first attempt of every ``refuse_every``-th new delivery id is answered 503, so that
  retries show; the retry (same delivery id) is accepted.
"""

from __future__ import annotations

import base64
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from ..errors import VerificationError
from ..signing import verify

_ATTEMPT = re.compile(r"[0-9]{1,9}", re.ASCII)

PATH = "/webhooks"


@dataclass(frozen=True, slots=True)
class Accepted:
    event_type: str
    body: bytes
    at: float  # time.time() when it was accepted


@dataclass
class Consumer:
    """The consumer and what it saw. Start with :meth:`start`, stop with :meth:`stop`."""

    secret: bytes
    refuse_every: int = 7
    host: str = "127.0.0.1"
    port: int = 0
    requests: int = 0
    refused: int = 0  # first attempts answered 503 on purpose
    retries: int = 0  # requests with x-fluxora-attempt > 1
    duplicates: int = 0
    signature_failures: int = 0
    failure_reasons: list[str] = field(default_factory=list)
    first_seen: dict[str, float] = field(default_factory=dict)  # delivery id -> time.time()
    accepted: dict[str, Accepted] = field(default_factory=dict)
    _runner: web.AppRunner | None = None

    def __post_init__(self) -> None:
        self._standard = _standard_verifier(self.secret)

    @property
    def standard_library(self) -> bool:
        """Whether the ``standardwebhooks`` package checks every request too."""
        return self._standard is not None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}{PATH}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post(PATH, self._receive)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        server: Any = site._server
        self.port = int(server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _receive(self, request: web.Request) -> web.Response:
        body = await request.read()
        now = time.time()
        self.requests += 1
        try:
            delivery_id = self.check_signatures(body, request.headers)
        except VerificationError as exc:
            return self._reject(f"{exc.reason}: {exc}")
        except Exception as exc:  # the standard library's error, or a malformed header
            return self._reject(f"{type(exc).__name__}: {exc}")
        if _attempt(request.headers) > 1:
            self.retries += 1
        if delivery_id in self.accepted:
            self.duplicates += 1
            return web.Response(status=200, text="duplicate")
        if delivery_id not in self.first_seen:
            self.first_seen[delivery_id] = now
            if len(self.first_seen) % self.refuse_every == 0:
                self.refused += 1
                return web.Response(status=503, text="try again later")
        event_type = request.headers.get("x-fluxora-event", "")
        self.accepted[delivery_id] = Accepted(event_type, body, now)
        return web.Response(status=200, text="ok")

    def check_signatures(self, body: bytes, headers: Mapping[str, str]) -> str:
        """Verify both schemes; the delivery id. Raises on any failure."""
        delivery_id = verify(body, headers, self.secret)  # Standard Webhooks: it is present
        original = {k: v for k, v in headers.items() if not k.lower().startswith("webhook-")}
        if verify(body, original, self.secret) != delivery_id:  # x-fluxora-signature
            raise VerificationError("id_mismatch", "the two schemes name different ids")
        if self._standard is not None:
            self._standard.verify(body, {k.lower(): v for k, v in headers.items()})
        return delivery_id

    def _reject(self, reason: str) -> web.Response:
        self.signature_failures += 1
        if len(self.failure_reasons) < 5:
            self.failure_reasons.append(reason)
        return web.Response(status=401, text="signature verification failed")


def _attempt(headers: Mapping[str, str]) -> int:
    text = headers.get("x-fluxora-attempt", "1")
    # ASCII digits, bounded: "²".isdigit() is true and int() then raises.
    return int(text) if _ATTEMPT.fullmatch(text) else 1


def _standard_verifier(secret: bytes) -> Any:
    """A verifier from the ``standardwebhooks`` package (the reference implementation of
    the scheme), or None when it is not installed."""
    try:
        from standardwebhooks.webhooks import Webhook
    except ImportError:  # pragma: no cover - installed with the dev extra
        return None
    # The library takes its key as "whsec_" + base64; our secret is a plain one.
    return Webhook("whsec_" + base64.b64encode(secret).decode())
