"""One HTTP attempt and its classification into an :class:`AttemptResult`.

| response                                   | kind        |
|--------------------------------------------|-------------|
| any 2xx                                    | delivered   |
| network error, timeout, 408, 425, 429, 5xx | retryable   |
| other 4xx, 3xx (never followed)            | permanent   |
"""

from __future__ import annotations

import dataclasses
import functools
import ssl
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .errors import EndpointError
from .httpclient import (
    ConnectFailed,
    EgressFailed,
    HttpClient,
    ProtocolError,
    ResolverFailed,
    Response,
    tls_failure,
)
from .logs import mask, url_secrets
from .retry import Kind, parse_http_date, parse_retry_after
from .urlpolicy import redacted

RETRYABLE_STATUS = frozenset({408, 425, 429})


@dataclass(frozen=True, slots=True)
class AttemptResult:
    kind: Kind
    status: int | None = None
    error: str | None = None
    body: str | None = None
    duration_ms: float = 0.0
    retry_after_ms: int | None = None
    reason: str = ""  # for a permanent failure: http_4xx, http_3xx, endpoint_refused, ...


# The reason of an attempt that failed at the egress proxy, before any consumer was asked
# (httpclient.EgressFailed): held for its retry delay without using up the attempt, and
# counted against no endpoint (batch.outcome_of).
EGRESS = "egress"
# What such a held delivery says while it waits (its row's error until it is sent: the
# API's wait_reason, the dashboard's "why it waits"). Tenants read it: no address.
EGRESS_HELD = (
    "held: this service's egress proxy failed, so no consumer was asked and no attempt is"
    " used; it is sent when the proxy answers again"
)
# The same for an attempt whose lookup failed because this service's DNS resolver fails
# (httpclient.ResolverFailed, egress.ResolverWatch), and what its row says meanwhile.
RESOLVER = "resolver"
RESOLVER_HELD = (
    "held: this service's DNS lookups failed, so no consumer was asked and no attempt is"
    " used; it is sent when lookups work again"
)
# Each reason of an attempt held on this service's side, and what its held row says.
HELD = {EGRESS: EGRESS_HELD, RESOLVER: RESOLVER_HELD}
HELD_WORDS = list(HELD.values())  # what the held count looks for (ops, deliveries)


def classify_status(status: int) -> Kind:
    if 200 <= status < 300:
        return Kind.DELIVERED
    if status in RETRYABLE_STATUS or status >= 500:
        return Kind.RETRYABLE
    if 300 <= status < 500:
        return Kind.PERMANENT
    return Kind.RETRYABLE  # 1xx or nonsense: try again later


def clean_text(data: bytes) -> str:
    """Response bytes as storable text (PostgreSQL text cannot hold NUL)."""
    return data.decode("utf-8", errors="replace").replace("\x00", "\ufffd")


async def attempt(
    client: HttpClient,
    url: str,
    body: bytes,
    headers: dict[str, str],
    *,
    timeout_s: float,
    max_response_bytes: int,
    clock: Callable[[], float] = time.time,
    secrets: Sequence[str] = (),
) -> AttemptResult:
    """POST once; never raises for what the consumer or the network does. ``clock`` is
    this process's wall clock (used only when a consumer's ``Retry-After`` date comes
    without a usable ``Date`` header).

    The response body and error text are stored, so they are scrubbed as logs are: the
    URL's token-bearing parts and ``secrets`` (the signing secrets, see
    :func:`secret_texts`) are masked, whatever the consumer echoed back."""
    result = await _post(
        client,
        url,
        body,
        headers,
        timeout_s=timeout_s,
        max_response_bytes=max_response_bytes,
        clock=clock,
    )
    return _scrubbed(result, url, secrets)


def secret_texts(*secrets: bytes | None) -> tuple[str, ...]:
    """The forms in which a signing secret could come back in a response: as written and,
    for a ``whsec_`` secret, its base64 part."""
    found: list[str] = []
    for secret in secrets:
        if not secret:
            continue
        text = secret.decode("utf-8", "replace")
        found.append(text)
        if text.startswith("whsec_"):
            found.append(text[len("whsec_") :])
    return tuple(found)


# A custom header's value shorter than this is kept in stored text: "blue" or "v2" would
# mask the same word everywhere in a consumer's answer, and a credential is longer.
MIN_MASKED_HEADER = 8


def header_texts(headers: Mapping[str, str]) -> tuple[str, ...]:
    """The forms in which an endpoint's custom header values (an ``Authorization`` for
    its consumer, an API key) could come back in a response: each value of at least
    :data:`MIN_MASKED_HEADER` characters, and its part after a scheme word (the token of
    ``Bearer <token>``)."""
    found: list[str] = []
    for value in headers.values():
        text = value.strip()
        if len(text) < MIN_MASKED_HEADER:
            continue
        found.append(text)
        scheme, _, rest = text.partition(" ")
        rest = rest.strip()
        if scheme and len(rest) >= MIN_MASKED_HEADER:
            found.append(rest)
    return tuple(found)


# As many URLs as the HTTP client keeps origins for (httpclient._origin): a recorded
# attempt reads its endpoint's parts here, parsed once.
@functools.lru_cache(maxsize=4096)
def _url_secrets(url: str) -> tuple[str, ...]:
    return url_secrets(url)


def scrub_stored(text: str | None, url: str, secrets: Sequence[str] = ()) -> str | None:
    """What is stored of a consumer's text or an error: the URL cut to scheme and host, its
    token-bearing parts (query values, path) and the signing secrets masked."""
    if not text:
        return text
    return mask(scrub(text, url), (*_url_secrets(url), *secrets))


def _scrubbed(result: AttemptResult, url: str, secrets: Sequence[str]) -> AttemptResult:
    body = scrub_stored(result.body, url, secrets)
    error = scrub_stored(result.error, url, secrets)
    if body == result.body and error == result.error:
        return result
    return dataclasses.replace(result, body=body, error=error)


async def _post(
    client: HttpClient,
    url: str,
    body: bytes,
    headers: dict[str, str],
    *,
    timeout_s: float,
    max_response_bytes: int,
    clock: Callable[[], float],
) -> AttemptResult:
    started = time.perf_counter()

    def elapsed() -> float:
        return (time.perf_counter() - started) * 1000

    try:
        response = await client.post(
            url, body, headers, timeout_s=timeout_s, max_body=max_response_bytes
        )
    except EndpointError as exc:
        return AttemptResult(
            Kind.PERMANENT, error=str(exc), duration_ms=elapsed(), reason="endpoint_refused"
        )
    except TimeoutError:
        return AttemptResult(
            Kind.RETRYABLE, error="timeout", duration_ms=elapsed(), reason="timeout"
        )
    except ConnectFailed as exc:
        return AttemptResult(
            Kind.RETRYABLE,
            error=f"connection failed to {redacted(url)}: {exc.strerror or 'unreachable'}",
            duration_ms=elapsed(),
            reason=(
                EGRESS
                if isinstance(exc, EgressFailed)
                else RESOLVER
                if isinstance(exc, ResolverFailed)
                else "connection_error"
            ),
        )
    except ssl.SSLError as exc:  # after the handshake (TLS 1.3 asks for a client cert then)
        return AttemptResult(
            Kind.RETRYABLE,
            error=f"{redacted(url)}: {tls_failure(exc, handshake=False)}",
            duration_ms=elapsed(),
            reason="network_error",
        )
    except (ProtocolError, OSError) as exc:
        return AttemptResult(
            Kind.RETRYABLE,
            error=f"{type(exc).__name__}: {scrub(_short(exc), url)}",
            duration_ms=elapsed(),
            reason="network_error",
        )
    except (ValueError, TypeError, UnicodeError) as exc:
        # The request itself cannot be built (e.g. an event type unfit for a header).
        return AttemptResult(
            Kind.PERMANENT,
            error=f"invalid request: {type(exc).__name__}: {scrub(_short(exc), url)}",
            duration_ms=elapsed(),
            reason="invalid_request",
        )
    status = response.status
    kind = classify_status(status)
    retry_after = (
        parse_retry_after(response.headers.get("retry-after"), _consumer_now(response, clock))
        if kind is Kind.RETRYABLE
        else None
    )
    reason = ""
    if kind is Kind.PERMANENT:
        reason = "http_3xx" if status < 400 else "http_4xx"
    # The status is what counts; a body cut short is recorded, not retried.
    return AttemptResult(
        kind,
        status=status,
        error=response.body_error or (None if kind is Kind.DELIVERED else f"HTTP {status}"),
        body=clean_text(response.body),
        duration_ms=elapsed(),
        retry_after_ms=retry_after,
        reason=reason,
    )


def _consumer_now(response: Response, clock: Callable[[], float]) -> float:
    """The moment of the response on the consumer's clock (its ``Date`` header).

    A ``Retry-After`` HTTP date is measured against it, so the delay (and the due time the
    database derives from it) does not depend on this process's clock: one running hours
    behind used to schedule such a retry hours late. Without a usable ``Date`` header,
    this process's clock.
    """
    when = parse_http_date(response.headers.get("date"))
    return clock() if when is None else when


def scrub(text: str, url: str) -> str:
    """Remove the URL (which may carry a token) from an error text, leaving scheme and host."""
    if url and url in text:
        text = text.replace(url, redacted(url))
    base = url.split("?", 1)[0]
    if base and base in text:
        text = text.replace(base, redacted(url))
    return text


def _short(exc: BaseException, limit: int = 300) -> str:
    text = str(exc)
    return text if len(text) <= limit else text[:limit] + "..."
