"""A request rate limit per credential (``WEBHOOK_API_RATE_LIMIT``, docs/api.md, "Request
rate limit"): a token bucket per API token, per dashboard session and, for requests whose
credential is not proven yet, per client address; in this process's memory.

A credential has a bucket of its own once it has authenticated in this process: until
then (its first request, or the first after its bucket was dropped) a request is counted
against its client address, and moved to the credential's bucket when it authenticates.
Requests with invented tokens or sessions therefore share their address's bucket instead
of each getting a full bucket of its own.

Buckets are kept by a hash of the credential (never the credential itself). A bucket that
has filled up again is no different from none and is dropped; at most
:data:`MAX_BUCKETS` are kept (the least recently used go first). Which credentials have
authenticated is kept apart (as many, by the same hash), so a credential whose bucket was
dropped still counts against its own bucket, not its address's: a client flooding from a
shared address does not hold back the first request of an idle user's token."""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request, cookie_parser

from .. import logs
from ..settings import format_ms
from . import errors

log = logging.getLogger("fluxora_webhooks.api")

# Buckets kept at most: a few MB. Past it the least recently used is dropped (it refills at
# once), which only a flood of this many distinct credentials or addresses within one
# refill period can cause.
MAX_BUCKETS = 10_000
# Buckets checked for refilling per request (the least recently used first).
_SWEEP = 8
# Paths never limited: the platform's probes, the metrics, the dashboard's static files
# (a page's stylesheet and script are files read from disk, and would count each page
# three times).
EXEMPT = ("/healthz", "/readyz", "/metrics")
EXEMPT_PREFIXES = ("/static/",)
# Set in a request's scope once its credential authenticated (:func:`proven`).
_PROVEN = "fluxora.rate_limit.proven"
_SESSION_COOKIE = "fx_session"  # dashboard.render.SESSION_COOKIE (imported the other way)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Any]]
Send = Callable[[Any], Awaitable[None]]


@dataclass(frozen=True)
class Decision:
    """One request's count: whether it is admitted, and what the headers say."""

    allowed: bool
    limit: int
    remaining: int
    reset_s: int  # until the bucket is full again
    retry_after_s: int  # until the next request is admitted (1 at least)

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [
            (b"ratelimit-limit", str(self.limit).encode()),
            (b"ratelimit-remaining", str(self.remaining).encode()),
            (b"ratelimit-reset", str(self.reset_s).encode()),
        ]


class _Bucket:
    __slots__ = ("at", "label", "tokens")

    def __init__(self, tokens: float, at: float, label: str) -> None:
        self.tokens = tokens
        self.at = at
        self.label = label


class Limiter:
    """Token buckets of ``requests`` tokens, each refilled at ``requests`` per ``per_ms``:
    a burst of ``requests`` at once, ``requests`` per period sustained. ``clock`` gives
    seconds (monotonic)."""

    def __init__(
        self,
        requests: int,
        per_ms: int,
        *,
        max_buckets: int = MAX_BUCKETS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if requests < 1 or per_ms < 1:
            raise ValueError("a rate limit needs at least 1 request per 1 ms")
        self.requests = requests
        self.per_ms = per_ms
        self.capacity = float(requests)
        self.rate = requests * 1000.0 / per_ms  # tokens a second
        self.max_buckets = max_buckets
        self._clock = clock
        self._buckets: OrderedDict[bytes, _Bucket] = OrderedDict()
        # Credentials that authenticated here: their label, the least recently seen first.
        self._proven: OrderedDict[bytes, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._buckets)

    def known(self, key: bytes) -> bool:
        """Whether the credential ``key`` authenticated in this process (and is still
        remembered): its requests count against a bucket of its own."""
        if key not in self._proven:
            return False
        self._proven.move_to_end(key)
        return True

    def prove(self, key: bytes, label: str) -> None:
        """The credential ``key`` authenticated (``label`` names it in the log)."""
        self._proven[key] = label
        self._proven.move_to_end(key)
        while len(self._proven) > self.max_buckets:
            self._proven.popitem(last=False)

    def label(self, key: bytes) -> str:
        bucket = self._buckets.get(key)
        return bucket.label if bucket is not None and bucket.label else self._proven.get(key, "")

    def _level(self, bucket: _Bucket, now: float) -> float:
        return min(self.capacity, bucket.tokens + max(0.0, now - bucket.at) * self.rate)

    def take(self, key: bytes, *, label: str = "", force: bool = False) -> Decision:
        """Count one request against ``key``'s bucket; ``force``: admitted even when empty
        (a request admitted already, moved here)."""
        now = self._clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(self.capacity, now, label)
        else:
            self._buckets.move_to_end(key)
            if label:
                bucket.label = label
        tokens = self._level(bucket, now)
        allowed = tokens >= 1.0 or force
        if allowed:
            tokens = max(0.0, tokens - 1.0)
        bucket.tokens, bucket.at = tokens, now
        self._sweep(now)  # others: this one is the most recently used
        while len(self._buckets) > self.max_buckets:
            self._buckets.popitem(last=False)
        wait_s = math.ceil((1.0 - tokens) / self.rate) if tokens < 1.0 else 0
        return Decision(
            allowed=allowed,
            limit=self.requests,
            remaining=int(tokens),
            reset_s=math.ceil((self.capacity - tokens) / self.rate - 1e-9),
            retry_after_s=max(1, wait_s),
        )

    def refund(self, key: bytes) -> None:
        """Give back a request counted against ``key`` (moved to another bucket)."""
        bucket = self._buckets.get(key)
        if bucket is not None:
            now = self._clock()
            bucket.tokens, bucket.at = min(self.capacity, self._level(bucket, now) + 1.0), now

    def _sweep(self, now: float) -> None:
        """Drop the least recently used buckets that have filled up again."""
        for _ in range(_SWEEP):
            if not self._buckets:
                return
            key, bucket = next(iter(self._buckets.items()))
            if self._level(bucket, now) < self.capacity:
                return
            del self._buckets[key]


def proven(scope: Scope, label: str) -> None:
    """The request's credential authenticated (``label`` names it in a log line, never the
    credential itself): its requests count against a bucket of its own from now on."""
    scope[_PROVEN] = label


def _digest(kind: bytes, value: bytes) -> bytes:
    return kind + hashlib.blake2b(value, digest_size=16).digest()


def _header(scope: Scope, name: bytes) -> bytes:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value)
    return b""


def credential_key(scope: Scope) -> tuple[bytes, str] | None:
    """The key of the request's credential and what it is: an API path's bearer token, a
    dashboard path's session cookie; None without one."""
    if str(scope.get("path", "")).startswith(errors.API_PREFIX):
        scheme, _, token = _header(scope, b"authorization").strip().partition(b" ")
        token = token.strip()
        if scheme.lower() == b"bearer" and token:
            return _digest(b"t", token), "token"
        return None
    cookie = _header(scope, b"cookie")
    if cookie:
        session = cookie_parser(cookie.decode("latin-1")).get(_SESSION_COOKIE, "")
        if session:
            return _digest(b"s", session.encode("utf-8", "surrogateescape")), "session"
    return None


def address_key(scope: Scope) -> tuple[bytes, str]:
    """The client's address (an IPv6 client's /64, which one client holds whole)."""
    client = scope.get("client")
    host = str(client[0]) if client else ""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return b"a" + host.encode("utf-8", "surrogateescape"), f"client {host or 'unknown'}"
    if address.version == 6 and address.ipv4_mapped is None:
        network = ipaddress.ip_network(f"{address}/64", strict=False)
        return b"a" + network.network_address.packed, f"client {network}"
    shown = str(address.ipv4_mapped or address) if address.version == 6 else str(address)
    return b"a" + shown.encode(), f"client {shown}"


def limited(path: str) -> bool:
    return path not in EXEMPT and not path.startswith(EXEMPT_PREFIXES)


class RateLimit:
    """ASGI middleware: the limit on every path but :data:`EXEMPT`; ``RateLimit-Limit``,
    ``RateLimit-Remaining`` and ``RateLimit-Reset`` on each of their answers, and past
    the limit a 429 with ``Retry-After`` in the error shape (the dashboard's error page on
    its paths), before the request reads its body or takes a database connection."""

    def __init__(
        self,
        app: Callable[[Scope, Receive, Send], Awaitable[None]],
        limit: tuple[int, int] | None,
        html_error: Callable[..., Any],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.app = app
        self.limiter = None if limit is None else Limiter(*limit, clock=clock)
        self.html_error = html_error
        self._notice = logs.Notice(60.0)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limiter = self.limiter
        if limiter is None or scope["type"] != "http" or not limited(str(scope.get("path", ""))):
            await self.app(scope, receive, send)
            return
        credential = credential_key(scope)
        address, address_label = address_key(scope)
        own = credential is not None and limiter.known(credential[0])
        key = credential[0] if credential is not None and own else address
        decision = limiter.take(key, label="" if own else address_label)
        if not decision.allowed:
            await self._refuse(scope, receive, send, decision, key, credential)
            return

        async def counted(message: Any) -> None:
            nonlocal decision
            if message["type"] == "http.response.start":
                label = scope.get(_PROVEN)
                if credential is not None and not own and label is not None:
                    # Authenticated: the request counts against its credential, not its
                    # address, and the credential has its bucket from now on.
                    limiter.refund(address)
                    limiter.prove(credential[0], str(label))
                    decision = limiter.take(credential[0], label=str(label), force=True)
                message["headers"] = [*message.get("headers", []), *decision.headers()]
            await send(message)

        await self.app(scope, receive, counted)

    async def _refuse(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        decision: Decision,
        key: bytes,
        credential: tuple[bytes, str] | None,
    ) -> None:
        assert self.limiter is not None
        limiter = self.limiter
        period = format_ms(limiter.per_ms)
        if credential is not None and key == credential[0]:
            whose = credential[1]
            counted_as = f"for this {whose}"
        else:
            # A valid token refused here has not authenticated in this process yet (or
            # was forgotten past MAX_BUCKETS): say why its address is what was counted.
            whose = "address"
            counted_as = (
                "from this client address (a token or session counts against its address"
                " until it has authenticated)"
            )
        message = (
            f"too many requests {counted_as}: at most {limiter.requests} per {period}"
            f" (a burst of {limiter.requests}); try again in {decision.retry_after_s} s"
        )
        unsaid = self._notice.due()
        if unsaid is not None:
            more = f"; {unsaid} more since the last such line" if unsaid else ""
            log.warning(
                "rate limit: answered 429 to %s (%d requests per %s, WEBHOOK_API_RATE_LIMIT)%s",
                limiter.label(key) or whose,
                limiter.requests,
                period,
                more,
            )
        headers = {"Retry-After": str(decision.retry_after_s)}
        headers.update((k.decode(), v.decode()) for k, v in decision.headers())
        response: Any
        if str(scope.get("path", "")).startswith(errors.API_PREFIX):
            response = errors.error_response(429, "rate_limited", message, headers)
        else:
            response = self.html_error(Request(scope), 429, message)
            response.headers.update(headers)
        await response(scope, receive, send)
