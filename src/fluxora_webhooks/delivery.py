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
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp

from .errors import EndpointError
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


async def read_capped(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """Up to ``limit`` bytes of the body; a larger body is truncated, not an error."""
    chunks: list[bytes] = []
    size = 0
    while size < limit:
        chunk = await response.content.read(limit - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


async def attempt(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    headers: dict[str, str],
    *,
    timeout: aiohttp.ClientTimeout,
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
        session,
        url,
        body,
        headers,
        timeout=timeout,
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


@functools.lru_cache(maxsize=1024)
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
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    headers: dict[str, str],
    *,
    timeout: aiohttp.ClientTimeout,
    max_response_bytes: int,
    clock: Callable[[], float],
) -> AttemptResult:
    started = time.perf_counter()

    def elapsed() -> float:
        return (time.perf_counter() - started) * 1000

    try:
        async with session.post(
            url, data=body, headers=headers, allow_redirects=False, timeout=timeout
        ) as response:
            status = response.status
            kind = classify_status(status)
            try:
                raw = await read_capped(response, max_response_bytes)
            except (aiohttp.ClientError, TimeoutError) as exc:
                # The status is what counts; a body cut short is recorded, not retried.
                raw = b""
                body_error: str | None = f"response body unreadable: {type(exc).__name__}"
            else:
                body_error = None
            retry_after = (
                parse_retry_after(
                    response.headers.get("Retry-After"), _consumer_now(response, clock)
                )
                if kind is Kind.RETRYABLE
                else None
            )
            reason = ""
            if kind is Kind.PERMANENT:
                reason = "http_3xx" if status < 400 else "http_4xx"
            return AttemptResult(
                kind,
                status=status,
                error=body_error or (None if kind is Kind.DELIVERED else f"HTTP {status}"),
                body=clean_text(raw),
                duration_ms=elapsed(),
                retry_after_ms=retry_after,
                reason=reason,
            )
    except EndpointError as exc:
        return AttemptResult(
            Kind.PERMANENT, error=str(exc), duration_ms=elapsed(), reason="endpoint_refused"
        )
    except TimeoutError:
        return AttemptResult(
            Kind.RETRYABLE, error="timeout", duration_ms=elapsed(), reason="timeout"
        )
    except aiohttp.ClientConnectorError as exc:
        refused = _endpoint_error(exc)
        if refused is not None:
            return AttemptResult(
                Kind.PERMANENT,
                error=str(refused),
                duration_ms=elapsed(),
                reason="endpoint_refused",
            )
        return AttemptResult(
            Kind.RETRYABLE,
            error=f"connection failed to {redacted(url)}: {_os_error_text(exc)}",
            duration_ms=elapsed(),
            reason="connection_error",
        )
    except (aiohttp.ClientError, OSError) as exc:
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


def _consumer_now(response: aiohttp.ClientResponse, clock: Callable[[], float]) -> float:
    """The moment of the response on the consumer's clock (its ``Date`` header).

    A ``Retry-After`` HTTP date is measured against it, so the delay (and the due time the
    database derives from it) does not depend on this process's clock: one running hours
    behind used to schedule such a retry hours late. Without a usable ``Date`` header,
    this process's clock.
    """
    when = parse_http_date(response.headers.get("Date"))
    return clock() if when is None else when


def _endpoint_error(exc: BaseException) -> EndpointError | None:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, EndpointError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    oserr = getattr(exc, "os_error", None)
    return oserr if isinstance(oserr, EndpointError) else None


def _os_error_text(exc: aiohttp.ClientConnectorError) -> str:
    os_error = exc.os_error
    return os_error.strerror or type(os_error).__name__


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
