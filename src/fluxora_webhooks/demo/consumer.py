"""The demo's consumers: one HTTP server on loopback per endpoint, each behaving as a careful
consumer should, and each told by the demo how to misbehave when a step needs it.

- Every request is verified with the endpoint's own secret by
  :func:`fluxora_webhooks.signing.verify`, once per scheme (Standard Webhooks, then the
  original ``x-fluxora-signature``), and with the ``standardwebhooks`` package when it is
  installed. A request that fails any check is answered 401 and counted as a signature
  failure.
- Deliveries are de-duplicated by delivery id: a second copy of an accepted delivery is a
  duplicate (answered 200, so the sender stops).
- ``refuse_every``: the first attempt of every n-th new delivery id is answered 503, so that
  retries show; the retry (same delivery id) is accepted.
- Modes: ``up`` (the above), ``hang`` (the endpoint is down: a request is held past the
  sender's timeout and never accepted), ``reject`` (a bad deploy on one of two servers:
  every second request is answered 422, which the sender takes as permanent; the
  others are accepted as usual).
- ``ordered``: the consumer checks, at receipt, that no event of a stream comes before the
  previous one (by the payload's ``version``) was accepted. :meth:`Consumer.hold_back`
  refuses the next delivery of one stream a few times, to make that stream's head retry.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
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
MODES = ("up", "hang", "reject")
# A hung request is let go after this long at the latest (the sender gave up long before).
_HANG_MAX_S = 30.0

EventKey = tuple[str, str]  # (event type, the payload as canonical JSON)


def event_key(event_type: str, payload: Any) -> EventKey:
    """What identifies an event across its deliveries: its type and its payload."""
    return event_type, json.dumps(payload, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class Accepted:
    event_type: str
    payload: Any
    attempt: int
    at: float  # time.time() when it was accepted

    @property
    def key(self) -> EventKey:
        return event_key(self.event_type, self.payload)


@dataclass
class HoldBack:
    """The next delivery of ``stream`` is refused ``times`` times (its stream's head retries)."""

    stream: str
    times: int
    refused: int = 0
    delivery_id: str | None = None
    first_refused_at: float | None = None
    accepted_at: float | None = None


@dataclass
class Consumer:
    """One endpoint's consumer and what it saw. Start with :meth:`start`, stop with
    :meth:`stop`. ``secret`` is the endpoint's signing secret as registered."""

    name: str
    secret: str
    refuse_every: int = 0  # 0: never refuse on purpose
    ordered: bool = False
    mode: str = "up"
    host: str = "127.0.0.1"
    port: int = 0
    requests: int = 0
    refused: int = 0  # first attempts answered 503 on purpose
    retries: int = 0  # requests with x-fluxora-attempt > 1
    duplicates: int = 0
    hung: int = 0  # requests held while down
    rejected: dict[str, float] = field(default_factory=dict)  # delivery id -> first 422
    signature_failures: int = 0
    failure_reasons: list[str] = field(default_factory=list)
    first_seen: dict[str, float] = field(default_factory=dict)  # delivery id -> time.time()
    seen: dict[str, EventKey] = field(default_factory=dict)  # every verified delivery's event
    accepted: dict[str, Accepted] = field(default_factory=dict)
    order_violations: list[str] = field(default_factory=list)
    held: HoldBack | None = None
    # One verified request (body, headers), to show that no other endpoint's secret fits it.
    sample: tuple[bytes, dict[str, str]] | None = None
    _versions: dict[str, int] = field(default_factory=dict)  # stream -> last accepted version
    _reject_turn: int = 0
    _up: asyncio.Event = field(default_factory=asyncio.Event)
    _runner: web.AppRunner | None = None

    def __post_init__(self) -> None:
        self._standard = _standard_verifier(self.secret) if self.secret else None
        self.set_mode(self.mode)

    @property
    def standard_library(self) -> bool:
        """Whether the ``standardwebhooks`` package checks every request too."""
        return self._standard is not None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}{PATH}"

    def set_mode(self, mode: str) -> None:
        """``up``, ``hang`` or ``reject``; leaving ``hang`` lets the held requests go."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}")
        self.mode = mode
        self._reject_turn = 0
        if mode == "hang":
            self._up.clear()
        else:
            self._up.set()

    def use_secret(self, secret: str) -> None:
        """The secret the registry gave the endpoint (shown once, at its creation)."""
        self.secret = secret
        self._standard = _standard_verifier(secret)

    def hold_back(self, stream: str, times: int) -> HoldBack:
        self.held = HoldBack(stream, times)
        return self.held

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post(PATH, self._receive)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        server: Any = site._server
        self.port = int(server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        self._up.set()  # held requests end now
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
        if self.sample is None:
            self.sample = (body, dict(request.headers))
        event_type = request.headers.get("x-fluxora-event", "")
        try:
            payload = json.loads(body)
        except ValueError:
            payload = None
        self.seen.setdefault(delivery_id, event_key(event_type, payload))
        attempt = _attempt(request.headers)
        if attempt > 1:
            self.retries += 1
        if self.mode == "hang":
            self.hung += 1
            # Down: the request is held until the sender gives up (and then some).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._up.wait(), _HANG_MAX_S)
            return web.Response(status=503, text="down")
        if self.mode == "reject" and delivery_id not in self.accepted:
            # Every second request reaches the server with the bad deploy.
            self._reject_turn += 1
            if delivery_id in self.rejected or self._reject_turn % 2 == 1:
                self.rejected.setdefault(delivery_id, now)
                return web.Response(status=422, text="cannot process this payload")
        if delivery_id in self.accepted:
            self.duplicates += 1
            return web.Response(status=200, text="duplicate")
        first = delivery_id not in self.first_seen
        if first:
            self.first_seen[delivery_id] = now
        if self.ordered:
            self._check_order(payload)
        if self._hold(delivery_id, payload, now):
            return web.Response(status=503, text="try again later")
        # While rejecting, requests strictly alternate 422 and 200: a success always ends
        # the failure streak, so the endpoint is never disabled for it.
        refusing = self.refuse_every and self.mode == "up"
        if first and refusing and len(self.first_seen) % self.refuse_every == 0:
            self.refused += 1
            return web.Response(status=503, text="try again later")
        self.accepted[delivery_id] = Accepted(event_type, payload, attempt, now)
        if self.ordered and isinstance(payload, dict):
            stream, version = payload.get("id"), payload.get("version")
            if isinstance(stream, str) and isinstance(version, int):
                self._versions[stream] = max(version, self._versions.get(stream, 0))
        if self.held is not None and self.held.delivery_id == delivery_id:
            self.held.accepted_at = now
        return web.Response(status=200, text="ok")

    def _check_order(self, payload: Any) -> None:
        """A later event of a stream must not come before the previous one was accepted."""
        if not isinstance(payload, dict):
            self.order_violations.append("a delivery without a stream's payload")
            return
        stream, version = payload.get("id"), payload.get("version")
        if not isinstance(stream, str) or not isinstance(version, int):
            self.order_violations.append("a delivery without a stream id and version")
            return
        last = self._versions.get(stream, 0)
        if version > last + 1:
            self.order_violations.append(
                f"{stream}: version {version} arrived before version {last + 1} was accepted"
            )

    def _hold(self, delivery_id: str, payload: Any, now: float) -> bool:
        held = self.held
        if held is None or held.refused >= held.times or not isinstance(payload, dict):
            return False
        if held.delivery_id is None and payload.get("id") == held.stream:
            held.delivery_id = delivery_id
        if held.delivery_id != delivery_id:
            return False
        held.refused += 1
        if held.first_refused_at is None:
            held.first_refused_at = now
        return True

    def check_signatures(self, body: bytes, headers: Mapping[str, str]) -> str:
        """Verify both schemes with this endpoint's secret; the delivery id. Raises on any
        failure."""
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


def verifies_with(body: bytes, headers: Mapping[str, str], secret: str) -> bool:
    """Whether a request verifies (either scheme) with ``secret``."""
    for scheme in ("standard", "fluxora"):
        try:
            verify(body, headers, secret, scheme=scheme)
            return True
        except VerificationError:
            continue
    return False


def _attempt(headers: Mapping[str, str]) -> int:
    text = headers.get("x-fluxora-attempt", "1")
    # ASCII digits, bounded: "²".isdigit() is true and int() then raises.
    return int(text) if _ATTEMPT.fullmatch(text) else 1


def _standard_verifier(secret: str) -> Any:
    """A verifier from the ``standardwebhooks`` package (the reference implementation of
    the scheme), or None when it is not installed."""
    try:
        from standardwebhooks.webhooks import Webhook
    except ImportError:  # pragma: no cover - installed with the dev extra
        return None
    # The library takes its key as "whsec_" + base64; a plain secret is wrapped so.
    if secret.startswith("whsec_"):
        return Webhook(secret)
    return Webhook("whsec_" + base64.b64encode(secret.encode()).decode())
