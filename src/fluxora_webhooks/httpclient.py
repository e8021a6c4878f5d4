"""The dispatcher's HTTP/1.1 client: one POST per attempt over pooled keep-alive
connections, with nothing a webhook does not need.

A general-purpose client spends most of a webhook's CPU on what a webhook never uses
(cookies, redirects, proxies, streaming APIs, per-request header objects); this one writes
the request as one buffer and parses the response with httptools (llhttp, the parser of
Node.js and uvicorn), about a fifth of the CPU per request (docs/performance.md). What it
keeps is what SPEC sections 4 and 7 require:

- every connection goes to an address the address policy allowed: names are resolved
  through :class:`~fluxora_webhooks.connector.SafeResolver` (checked, and the connection
  pinned to the checked address: no second resolution to rebind), IP literals are checked
  as they are, and each address is checked again just before connecting;
- redirects are never followed (a 3xx is an answer like any other);
- one timeout bounds the whole attempt, connecting included;
- the response body is read up to a cap, the rest never (the connection is then closed);
- a response head is bounded (8 KiB a line, 1 MiB in all), and so are a chunked body's
  trailers (read past, never kept), so a hostile consumer cannot make either grow without
  end;
- responses are parsed as leniently as aiohttp's client parses them (a folded header line,
  a bare LF, spaces after a chunk size), so an answer aiohttp reads as a 2xx is one here.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import ipaddress
import re
import socket
import ssl
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import cast

import httptools
import yarl

from .connector import SafeResolver, refuse_address
from .egress import ResolverWatch
from .errors import EndpointError
from .settings import Proxy
from .urlpolicy import LOOPBACK_NAMES, IPNetwork, parse_ip

# A response head line longer than this, or a head longer than MAX_HEAD, is refused as
# unparseable (aiohttp's client takes lines of up to 8190 bytes; a little more room costs
# nothing and refuses the same 100 KB lines).
MAX_LINE = 8190
MAX_HEAD = 1 << 20
# Idle keep-alive connections are kept this long (consumers usually close theirs after
# 60-75 s; closing ours first avoids sending on a connection being closed), and at most
# this many per origin.
KEEPALIVE_S = 15.0
MAX_IDLE_PER_ORIGIN = 256
DNS_CACHE_S = 10.0


class ProtocolError(Exception):
    """The consumer's answer is not an HTTP/1.1 response we can read."""


class ConnectFailed(OSError):
    """No connection could be made to any allowed address of the endpoint."""


class EgressFailed(ConnectFailed):
    """The egress proxy failed, not the consumer: it cannot be reached, did not answer
    within the request's timeout, gave no usable answer to ``CONNECT``, or refused this
    service's user and password (407). The consumer
    was never asked, so the attempt says nothing of its endpoint (batch.outcome_of)."""


class ResolverFailed(ConnectFailed):
    """This service's DNS resolver failed, not the consumer (egress.ResolverWatch): lookups
    of names that resolved before get no answer, or are held while that lasts. The consumer
    was never asked, so the attempt says nothing of its endpoint (batch.outcome_of)."""


# What a lookup that got no answer fails with: the resolver's trouble (or the name's own
# servers'), unlike "no such name", which is an answer.
_NO_ANSWER = frozenset(
    code
    for code in (getattr(socket, "EAI_AGAIN", None), getattr(socket, "EAI_SYSTEM", None))
    if code is not None
) | {errno.ETIMEDOUT}


# What OpenSSL's reason codes mean to an operator, for the TLS failures a consumer's
# server causes most (the code alone, TLSV1_ALERT_PROTOCOL_VERSION, says it to few).
_TLS_REASONS = {
    "TLSV1_ALERT_PROTOCOL_VERSION": "no TLS version in common (TLS 1.2 or later is required)",
    "UNSUPPORTED_PROTOCOL": "no TLS version in common (TLS 1.2 or later is required)",
    "WRONG_SSL_VERSION": "no TLS version in common (TLS 1.2 or later is required)",
    "TLSV13_ALERT_CERTIFICATE_REQUIRED": "the consumer requires a client certificate",
    "WRONG_VERSION_NUMBER": "the consumer does not speak TLS on this port (plain http?)",
    "UNSAFE_LEGACY_RENEGOTIATION_DISABLED": (
        "the consumer does not support secure renegotiation (RFC 5746)"
    ),
}
_SSL_NOISE = re.compile(r"^\[SSL(?:: [A-Z0-9_]+)?\] |\s*\(_ssl\.c:\d+\)$")
_SSL_CLOSED = (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError)
# OpenSSL's verify codes of a chain that leads to no trusted CA: unable to get the issuer
# (2, 20), self-signed (18, 19), unable to verify the leaf's signature (21).
_UNKNOWN_ISSUER = frozenset({2, 18, 19, 20, 21})


def _during_handshake(exc: OSError) -> bool:
    """Whether a failed https connection failed in its TLS handshake: a TLS error, or the
    connection reset or aborted once made (a refused one is ``ConnectionRefusedError``)."""
    return isinstance(exc, (ssl.SSLError, ConnectionResetError, ConnectionAbortedError))


def tls_failure(exc: OSError, address: str | None = None, *, handshake: bool = True) -> str:
    """What a TLS failure with a consumer was, in words: the certificate check that
    failed, or the handshake's problem. ``exc`` is an ``ssl.SSLError``, or the connection
    lost during the handshake; ``address`` the address connected to, when the host is a
    name. ``handshake`` False: ``exc`` came after the handshake (an alert TLS 1.3 sends at
    the first read, such as a client certificate required, or a connection closed)."""
    if not handshake and isinstance(exc, _SSL_CLOSED):
        return "TLS connection closed by the consumer"
    at = f" at {address}" if address else ""
    if isinstance(exc, ssl.SSLCertVerificationError):
        why = exc.verify_message or exc.reason or "refused"
        text = f"TLS certificate not accepted{at}: {why}"
        if exc.verify_code in _UNKNOWN_ISSUER:
            text += (
                " (not signed by a CA this dispatcher trusts; a private CA is trusted with"
                " SSL_CERT_FILE or SSL_CERT_DIR)"
            )
        return text
    if isinstance(exc, ssl.SSLError) and not isinstance(exc, _SSL_CLOSED):
        known = _TLS_REASONS.get(exc.reason or "")
        said = _SSL_NOISE.sub("", exc.strerror or str(exc)).strip() or exc.reason
        if known is not None:
            return f"TLS handshake failed{at}: {known} ({said})"
        return f"TLS handshake failed{at}: {said or type(exc).__name__}"
    return f"TLS handshake failed{at}: the consumer closed the connection"


@dataclass
class Response:
    """One answer: its status, its headers (lowercase names, first occurrence), its body up
    to the cap, and, when the body was cut short by the peer, why."""

    status: int
    headers: dict[str, str]
    body: bytes
    body_error: str | None = None


@dataclass(frozen=True)
class _Origin:
    scheme: str
    host: str  # as connected to: an IP literal, or the IDNA-encoded name
    port: int
    host_header: str
    target: str  # path and query
    literal: bool

    @property
    def key(self) -> tuple[str, str, int]:
        return self.scheme, self.host, self.port


@lru_cache(maxsize=4096)
def _origin(url: str) -> _Origin:
    parsed = yarl.URL(url)
    host = parsed.raw_host or ""
    scheme = parsed.scheme.lower()
    port = parsed.port or (443 if scheme == "https" else 80)
    literal = parse_ip(host) is not None
    shown = f"[{host}]" if literal and ":" in host else host
    default = (scheme == "https" and port == 443) or (scheme == "http" and port == 80)
    target = parsed.raw_path_qs or "/"
    return _Origin(scheme, host, port, shown if default else f"{shown}:{port}", target, literal)


# What no HTTP field may hold (RFC 9110 5.5): control characters but the tab in a value; a
# line break would start another field.
_UNFIT = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def request_head(origin: _Origin, headers: Mapping[str, str], length: int) -> bytes:
    lines = [f"POST {origin.target} HTTP/1.1", f"host: {origin.host_header}"]
    lines.append(f"content-length: {length}")
    for name, value in headers.items():
        # A value may carry a row's own text (its event type, its trace context, written by
        # plain SQL): isprintable is one pass in C, and what it flags (a tab is allowed) is
        # looked at closer. The names are ours or were checked as the endpoint was saved.
        if (not value.isprintable() and _UNFIT.search(value)) or "\r" in name or "\n" in name:
            raise ValueError(f"the header {name[:40]!r} holds a control character")
        lines.append(f"{name}: {value}")
    # UTF-8, as aiohttp writes a head: an event type written by plain SQL may hold any
    # character (printable ASCII is what enqueue and the API take, and what encodes the same).
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8")


class _Connection(asyncio.Protocol):
    """One keep-alive connection: one request at a time."""

    def __init__(self, origin: _Origin) -> None:
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.reusable = False
        self.idle_since = 0.0
        self._waiter: asyncio.Future[Response] | None = None
        self._reset_message()

    def _reset_message(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        # What aiohttp's client allows too (it is strict only in its debug mode): a 2xx
        # it reads is delivered here, not retried as unreadable.
        self._parser.set_dangerous_leniencies(
            lenient_headers=True,
            lenient_optional_cr_before_lf=True,
            lenient_spaces_after_chunk_size=True,
        )
        self._reset_head()
        self._head_bytes = 0
        self._tail_bytes = 0
        self._chunks: list[bytes] = []
        self._size = 0
        self._cap = 0
        self._eof_ends_body = False

    def _reset_head(self) -> None:
        self._status = 0
        self._headers: dict[str, str] = {}
        self._head_done = False

    # -- asyncio.Protocol -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop hands over its own transport class, not asyncio.Transport.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # A request is one write, but the kernel must not hold it back behind a segment
            # the consumer has not acknowledged yet (Nagle's algorithm and delayed ACKs).
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self._waiter is None or self._waiter.done():
            self.reusable = False  # bytes nobody asked for: never reuse this connection
            self._close()
            return
        after_head = self._head_done
        if not after_head:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD:
                self._fail(ProtocolError("the response head is larger than 1 MiB"))
                return
        else:
            self._tail_bytes += len(data)  # on_body takes the body's share back out
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(ProtocolError("the consumer asked to switch protocols"))
            return
        except (httptools.HttpParserError, ValueError) as exc:
            cause = exc.__cause__ or exc.__context__
            self._fail(cause if isinstance(cause, ProtocolError) else ProtocolError(str(exc)))
            return
        # What came after the head that is no body: chunk sizes and trailers. A trailer
        # line is handed over only once it ends (until then the parser keeps adding to it),
        # so it is bounded here, with room for a body sent in the smallest chunks.
        if after_head and self._tail_bytes > MAX_HEAD + 8 * self._cap:
            self._too_much_after_body()

    def connection_lost(self, exc: Exception | None) -> None:
        self.reusable = False
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        if self._head_done:
            if exc is None and self._eof_ends_body:
                self._finish()  # a body delimited by the end of the connection
                return
            why = type(exc).__name__ if exc is not None else "ConnectionClosed"
            self._finish(body_error=f"response body unreadable: {why}")
            return
        waiter.set_exception(
            ConnectionResetError(
                errno.ECONNRESET, "the connection closed before a complete response head"
            )
            if exc is None
            else exc
        )

    # -- httptools callbacks ----------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._head_done:
            # A trailer of a chunked body: nothing here reads one. Past a line's bound (or
            # all of them past data_received's) the answer stands as it is (its status came
            # with the head), and the connection goes with the rest of them unread.
            if len(name) + len(value) > MAX_LINE:
                self._too_much_after_body()
            return
        if len(name) + len(value) > MAX_LINE:
            raise ProtocolError("a response header line is longer than 8190 bytes")
        key = name.decode("latin-1").lower()
        # llhttp strips the whitespace before a value, not after it (nor a folded line's).
        self._headers.setdefault(key, value.rstrip(b" \t").decode("latin-1"))

    def on_headers_complete(self) -> None:
        self._head_done = True
        self._status = self._parser.get_status_code()
        no_length = "content-length" not in self._headers
        chunked = "chunked" in self._headers.get("transfer-encoding", "").lower()
        bodiless = self._status in (204, 304) or 100 <= self._status < 200
        self._eof_ends_body = no_length and not chunked and not bodiless

    def _too_much_after_body(self) -> None:
        self.reusable = False
        self._finish(
            body_error="response trailers too large (a line over 8190 bytes, or over 1 MiB"
            " after the body)"
        )
        self._close()

    def on_body(self, body: bytes) -> None:
        self._tail_bytes -= len(body)
        room = self._cap - self._size
        if len(body) >= room:
            self._chunks.append(body[:room])
            self._size = self._cap
            self.reusable = False
            self._finish()  # the cap: the rest is never read
            self._close()
            return
        self._chunks.append(body)
        self._size += len(body)

    def on_message_complete(self) -> None:
        if 100 <= self._status < 200:
            # An interim response (100 Continue, 103 Early Hints): the final one follows on
            # the same connection, and a client must read past any number of them (RFC
            # 9110, 15.2). Their heads count toward the head's cap.
            self._reset_head()
            return
        self.reusable = self._parser.should_keep_alive()
        self._finish()

    # -- one request ------------------------------------------------------------------

    async def request(self, data: bytes, max_body: int, deadline: float) -> Response:
        """Send ``data`` and read the response, until the event loop's time ``deadline``
        (``TimeoutError`` then). The deadline is a timer of this request's own, cheaper
        than a task-wide ``asyncio.timeout`` on the path that every request takes."""
        assert self.transport is not None
        self._reset_message()
        self._cap = max_body
        self.reusable = False
        loop = asyncio.get_running_loop()
        self._waiter = loop.create_future()
        timer = loop.call_at(deadline, self._time_out)
        try:
            self.transport.write(data)
            return await self._waiter
        finally:
            timer.cancel()

    def _time_out(self) -> None:
        self._fail(TimeoutError())

    def partial(self, body_error: str) -> Response | None:
        """What came of the response so far, if its head is complete."""
        if not self._head_done:
            return None
        return Response(self._status, self._headers, b"".join(self._chunks), body_error)

    def _finish(self, body_error: str | None = None) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(
                Response(self._status, self._headers, b"".join(self._chunks), body_error)
            )

    def _fail(self, exc: BaseException) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        self.reusable = False
        self._close()

    def _close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    @property
    def silent(self) -> bool:
        """Nothing of a response has come on this request (yet)."""
        return self._head_bytes == 0

    @property
    def closed(self) -> bool:
        return self.transport is None or self.transport.is_closing()


@dataclass
class _DnsEntry:
    expires: float
    addresses: list[str] = field(default_factory=list)


@lru_cache(maxsize=1)
def default_ssl_context() -> ssl.SSLContext:
    """The system's trust store, loaded once per process. Loading it takes tens of
    milliseconds (more on a busy machine), so it is not done on the event loop per client:
    the dispatcher warms it in a thread at start (:func:`warm_ssl_context`), and plain-http
    consumers never need it."""
    return ssl.create_default_context()


@lru_cache(maxsize=4)
def client_ssl_context(cert: str, key: str | None) -> ssl.SSLContext:
    """The system's trust store and a client certificate (``cert``, its key in ``key`` or
    in ``cert``'s file) presented to consumers that ask for one: loaded once per process
    (a renewed certificate is read at the next start)."""
    context = ssl.create_default_context()
    context.load_cert_chain(cert, key)
    return context


async def warm_ssl_context(cert: str | None = None, key: str | None = None) -> None:
    if cert is None:
        await asyncio.to_thread(default_ssl_context)
    else:
        await asyncio.to_thread(client_ssl_context, cert, key)


# The longest answer to CONNECT read from a proxy (a status line and a few fields).
MAX_PROXY_HEAD = 16 * 1024


class _TunnelAnswer(asyncio.Protocol):
    """A proxy's answer to ``CONNECT``: its status and reason, once its head has ended."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.answer: asyncio.Future[tuple[int, str]] = loop.create_future()
        self._head = b""

    def data_received(self, data: bytes) -> None:
        if self.answer.done():
            return
        self._head += data
        end = self._head.find(b"\r\n\r\n")
        # The head so far, or whole: the cap holds however the reads cut it (one may bring
        # all of it).
        if (len(self._head) if end < 0 else end + 4) > MAX_PROXY_HEAD:
            self.answer.set_exception(OSError(errno.EPROTO, "an answer larger than 16 KiB"))
            return
        if end < 0:
            return
        version, _, rest = self._head.split(b"\r\n", 1)[0].decode("latin-1").partition(" ")
        code, _, reason = rest.partition(" ")
        # Three ASCII digits (a superscript two is a digit to isdigit, not to int).
        digits = code.isascii() and code.isdigit() and len(code) == 3
        if not version.startswith("HTTP/1.") or not digits:
            self.answer.set_exception(OSError(errno.EPROTO, "no HTTP answer"))
            return
        status = int(code)
        if 200 <= status < 300 and end + 4 != len(self._head):
            # Nothing may come before the consumer's part of the TLS handshake.
            self.answer.set_exception(OSError(errno.EPROTO, "bytes after its 2xx answer"))
            return
        shown = "".join(c if c.isprintable() else "?" for c in reason[:100]).strip()
        self.answer.set_result((status, shown))

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.answer.done():
            self.answer.set_exception(OSError(errno.ECONNRESET, "the connection was closed"))


class _Waiting:
    """What one request's new connection waits for: ``proxy`` while the egress proxy's
    connection or its answer to ``CONNECT`` is awaited (a timeout then is the proxy's);
    ``lookup`` (the name, when it began) while its address is looked up (a timeout then is
    the lookup's: the resolver's, perhaps)."""

    __slots__ = ("lookup", "proxy")

    def __init__(self) -> None:
        self.proxy: Proxy | None = None
        self.lookup: tuple[str, float] | None = None


class HttpClient:
    """POSTs webhooks. ``resolver`` is the address policy (a :class:`SafeResolver`);
    ``ssl_context`` verifies https consumers (the system's trust store by default).
    ``proxy``: https consumers are reached through its ``CONNECT`` tunnels, to the address
    the policy checked, except addresses in ``no_proxy`` (connected to directly); plain
    http goes to loopback only, directly."""

    def __init__(
        self,
        resolver: SafeResolver,
        *,
        ssl_context: ssl.SSLContext | None = None,
        proxy: Proxy | None = None,
        no_proxy: tuple[IPNetwork, ...] = (),
        resolving: ResolverWatch | None = None,
    ) -> None:
        self.resolver = resolver
        # The resolver's health, shared by a dispatcher's clients (its own when not given).
        self.resolving = resolving if resolving is not None else ResolverWatch()
        self._ssl = ssl_context
        self._proxy = proxy
        self._no_proxy = no_proxy
        self._idle: dict[tuple[str, str, int], collections.deque[_Connection]] = {}
        self._dns: dict[tuple[str, int], _DnsEntry] = {}
        self._closed = False
        self.opened = 0  # connections opened (keep-alive makes this small)

    async def post(
        self,
        url: str,
        body: bytes,
        headers: Mapping[str, str],
        *,
        timeout_s: float,
        max_body: int,
    ) -> Response:
        """POST ``body`` to ``url`` once. Raises :class:`~fluxora_webhooks.errors.
        EndpointError` (the address policy refused it), :class:`ConnectFailed`,
        ``TimeoutError``, :class:`ProtocolError` or another ``OSError``."""
        origin = _origin(url)
        data = request_head(origin, headers, len(body)) + body
        deadline = asyncio.get_running_loop().time() + timeout_s  # all of it, connecting too
        conn: _Connection | None = None
        waiting = _Waiting()
        try:
            conn = self._idle_connection(origin)
            if conn is not None:
                try:
                    response = await conn.request(data, max_body, deadline)
                except ConnectionError:
                    if not conn.silent:
                        raise
                    # The consumer closed an idle connection as we reused it (it had not
                    # seen the request, or not answered it): once more, on a new one.
                    conn = None
            if conn is None:
                async with asyncio.timeout_at(deadline):
                    conn = await self._connect(origin, waiting)
                response = await conn.request(data, max_body, deadline)
        except TimeoutError:
            if conn is None:
                if waiting.proxy is not None:  # the proxy did not answer, not the consumer
                    raise EgressFailed(
                        errno.ETIMEDOUT,
                        "the egress proxy did not answer within the timeout",
                    ) from None
                if waiting.lookup is not None and self.resolving.failed(*waiting.lookup):
                    # The request's time ran out in the lookup (a timeout under the
                    # resolver's own): no answer, as the resolver's own timeout says.
                    raise ResolverFailed(
                        errno.ETIMEDOUT,
                        "this service's DNS resolver fails (no answer within the timeout)",
                    ) from None
                raise
            conn.reusable = False
            conn._close()
            partial = conn.partial("response body unreadable: TimeoutError")
            if partial is None:
                raise
            return partial  # the head came in time: its status is the answer
        except BaseException:
            if conn is not None:
                conn.reusable = False
                conn._close()
            raise
        self._release(conn)
        return response

    async def close(self) -> None:
        self._closed = True
        self.close_idle()
        await self.resolver.close()

    def close_idle(self) -> None:
        """Close the idle keep-alive connections (the next request connects anew)."""
        for pool in self._idle.values():
            for conn in pool:
                conn._close()
        self._idle.clear()

    def clear_dns_cache(self) -> None:
        self._dns.clear()

    def _idle_connection(self, origin: _Origin) -> _Connection | None:
        pool = self._idle.get(origin.key)
        now = time.monotonic()
        while pool:
            conn = pool.pop()
            if not conn.closed and now - conn.idle_since < KEEPALIVE_S:
                return conn
            conn._close()
        return None

    def _release(self, conn: _Connection) -> None:
        if not conn.reusable or conn.closed or self._closed:
            conn._close()
            return
        pool = self._idle.setdefault(conn.origin.key, collections.deque())
        if len(pool) >= MAX_IDLE_PER_ORIGIN:
            conn._close()
            return
        conn.idle_since = time.monotonic()
        pool.append(conn)

    async def _addresses(self, origin: _Origin, waiting: _Waiting) -> list[str]:
        if origin.literal:
            return [origin.host]
        key = (origin.host, origin.port)
        entry = self._dns.get(key)
        now = time.monotonic()
        if entry is not None and entry.expires > now:
            return entry.addresses
        watch = self.resolving
        if watch.holding():  # the resolver fails: not tried (one probe every few seconds)
            raise ResolverFailed(socket.EAI_AGAIN, "held: this service's DNS lookups fail")
        began = watch.now()
        waiting.lookup = (origin.host, began)  # a timeout now is the lookup's
        try:
            answers = await self.resolver.resolve(origin.host, origin.port, family=socket.AF_UNSPEC)
        except EndpointError:  # resolved to addresses the policy refuses: said nothing of
            raise  # the resolver (the hosts file may have answered)
        except OSError as exc:  # no such name, a resolver timeout, no address
            why = exc.strerror or str(exc)
            if exc.errno not in _NO_ANSWER:
                if origin.host not in LOOPBACK_NAMES:
                    watch.answered()  # an answer ("no such name"): the resolver works
            elif watch.failed(origin.host, began):
                raise ResolverFailed(
                    exc.errno or socket.EAI_AGAIN, f"this service's DNS resolver fails ({why})"
                ) from exc
            raise ConnectFailed(exc.errno or errno.EHOSTUNREACH, why) from exc
        # Answered: a timeout from now on is the connection's (one cut in the lookup,
        # cancelling it, leaves ``waiting.lookup`` set for post).
        waiting.lookup = None
        if origin.host not in LOOPBACK_NAMES:  # the machine's own answer (hosts file):
            watch.answered(origin.host)  # it says nothing of the resolver
        addresses = list(dict.fromkeys(str(a["host"]) for a in answers))
        # Every cached answer was checked before it was cached; a short lifetime only keeps
        # up with legitimate DNS changes.
        self._dns[key] = _DnsEntry(now + DNS_CACHE_S, addresses)
        return addresses

    async def _connect(self, origin: _Origin, waiting: _Waiting) -> _Connection:
        loop = asyncio.get_running_loop()
        tls = origin.scheme == "https"
        last: OSError | None = None
        tls_failed: str | None = None  # a TLS failure says more than a later refusal
        egress = True  # every address failed at the egress proxy (EgressFailed)
        for address in await self._addresses(origin, waiting):
            reason = self.resolver.check(address)  # the last word: this very address
            if reason is not None:
                raise refuse_address(origin.host, address, reason)
            waiting.proxy = None  # set again by a tunnel to this address
            try:
                if tls and self._proxy is not None and not self._direct(address):
                    conn = await self._tunnel(self._proxy, origin, address, waiting)
                else:
                    _, conn = await loop.create_connection(
                        lambda: _Connection(origin),
                        host=address,
                        port=origin.port,
                        ssl=(self._ssl or default_ssl_context()) if tls else None,
                        # A fully qualified name's trailing dot is no part of the name a
                        # certificate holds, nor of SNI (RFC 6066): "hooks.example." is
                        # verified as "hooks.example", as browsers and curl do.
                        server_hostname=origin.host.rstrip(".") if tls else None,
                    )
            except OSError as exc:
                last = exc
                egress = egress and isinstance(exc, EgressFailed)
                if tls and _during_handshake(exc):
                    tls_failed = tls_failure(exc, None if origin.literal else address)
                continue
            self.opened += 1
            return conn
        if tls_failed is not None:
            raise ConnectFailed(errno.ECONNABORTED, tls_failed)
        if last is None:
            raise ConnectFailed(errno.EHOSTUNREACH, "no address to connect to")
        if egress:  # the proxy failed for every address: the consumer was never asked
            raise EgressFailed(last.errno or errno.ECONNABORTED, last.strerror)
        raise ConnectFailed(last.errno or errno.ECONNABORTED, last.strerror or type(last).__name__)

    def _direct(self, address: str) -> bool:
        ip = ipaddress.ip_address(address)
        return any(ip in net for net in self._no_proxy if net.version == ip.version)

    async def _tunnel(
        self, proxy: Proxy, origin: _Origin, address: str, stage: _Waiting
    ) -> _Connection:
        """A TLS connection to ``address`` through the proxy's ``CONNECT`` tunnel. The
        tunnel names the address the policy checked, never the host name: the proxy must
        not resolve it again (to an address the policy would refuse). ``stage.proxy`` is the
        proxy while its connection or its answer is awaited."""
        loop = asyncio.get_running_loop()
        target = f"[{address}]:{origin.port}" if ":" in address else f"{address}:{origin.port}"
        stage.proxy = proxy
        try:
            transport, waiting = await loop.create_connection(
                lambda: _TunnelAnswer(loop), proxy.host, proxy.port
            )
        except OSError as exc:
            raise EgressFailed(
                exc.errno or errno.ECONNREFUSED,
                f"the egress proxy cannot be reached ({exc.strerror or type(exc).__name__})",
            ) from None
        try:
            head = f"CONNECT {target} HTTP/1.1\r\nhost: {target}\r\n"
            if proxy.authorization is not None:
                head += f"proxy-authorization: {proxy.authorization}\r\n"
            transport.write((head + "\r\n").encode("ascii"))
            try:
                status, reason = await waiting.answer
            except OSError as exc:
                raise EgressFailed(
                    exc.errno or errno.EPROTO,
                    f"the egress proxy gave no usable answer to CONNECT {target}: {exc.strerror}",
                ) from None
            stage.proxy = None  # it answered: what follows is the consumer's part
            if not 200 <= status < 300:
                # 407: this service's credentials, no fault of the consumer's. Any other
                # refusal is about this target (a 403 of the proxy's rules, a 502 or 504
                # for a consumer it cannot reach): the endpoint's failure.
                failed = EgressFailed if status == 407 else ConnectFailed
                hint = " (the user and password of WEBHOOK_PROXY_URL)" if status == 407 else ""
                raise failed(
                    errno.ECONNREFUSED,
                    f"the egress proxy refused CONNECT {target}: {status} {reason}{hint}",
                )
            conn = _Connection(origin)
            tls_transport = await loop.start_tls(
                transport,
                conn,
                self._ssl or default_ssl_context(),
                server_hostname=origin.host.rstrip("."),
            )
        except BaseException:
            transport.close()
            raise
        if tls_transport is None:  # the proxy closed the tunnel as the handshake ended
            raise ConnectFailed(errno.ECONNRESET, "the egress proxy closed the tunnel")
        conn.connection_made(tls_transport)
        return conn
