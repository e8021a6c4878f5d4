"""The retry policy: schedule, jitter, Retry-After, and the dead-letter decision.

| attempt's kind | decision                                                     |
|----------------|--------------------------------------------------------------|
| delivered      | delivered                                                    |
| retryable      | retry after the schedule's delay (Retry-After may lengthen   |
|                | it), or dead letter (``attempts_exhausted``) after the last  |
| permanent      | dead letter, with the attempt's reason                       |

Pure functions of their inputs; randomness comes from an injected source, so a ten-hour
schedule is tested without sleeping.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from enum import Enum

from .outbox import Outcome

RETRY_AFTER_CAP_MS = 24 * 3_600_000
JITTER = 0.20

_CAP_S = RETRY_AFTER_CAP_MS // 1000
_DELTA_SECONDS = re.compile(r"[0-9]+", re.ASCII)
# An IMF-fixdate is 29 characters; the obsolete forms are no longer. A longer value is not a
# date, and parsing it is not worth the work.
_MAX_DATE_CHARS = 64


class Kind(Enum):
    """How one HTTP attempt ended, as far as retrying is concerned."""

    DELIVERED = "delivered"
    RETRYABLE = "retryable"
    PERMANENT = "permanent"


@dataclass(frozen=True, slots=True)
class Decision:
    """What to record for an attempt: ``delay_ms`` for a retry, ``reason`` for a dead
    letter."""

    outcome: Outcome
    delay_ms: int = 0
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    max_attempts: int
    schedule_ms: tuple[int, ...]
    jitter: Callable[[], float] = random.random  # uniform in [0, 1)

    def base_delay_ms(self, attempt: int) -> int:
        """Scheduled delay before attempt ``attempt + 1`` (attempt is the one that failed).

        A schedule shorter than the attempts repeats its last entry.
        """
        index = min(max(attempt, 1) - 1, len(self.schedule_ms) - 1)
        return self.schedule_ms[index]

    def delay_ms(self, attempt: int, retry_after_ms: int | None = None) -> int:
        """Delay with up to 20 % jitter (never shorter than scheduled); ``Retry-After``
        lengthens it, never shortens it, and is capped at 24 h."""
        delay = int(self.base_delay_ms(attempt) * (1 + JITTER * self.jitter()))
        if retry_after_ms is not None:
            delay = max(delay, min(retry_after_ms, RETRY_AFTER_CAP_MS))
        return delay

    def exhausted(self, attempt: int) -> bool:
        """True when the attempt that just failed was the last one allowed."""
        return attempt >= self.max_attempts

    def decide(
        self, attempt: int, kind: Kind, *, reason: str = "", retry_after_ms: int | None = None
    ) -> Decision:
        """The outcome of attempt number ``attempt``, which ended as ``kind`` (``reason``:
        why a permanent failure was permanent)."""
        if kind is Kind.DELIVERED:
            return Decision(Outcome.DELIVERED)
        if kind is Kind.RETRYABLE and not self.exhausted(attempt):
            return Decision(Outcome.RETRY, delay_ms=self.delay_ms(attempt, retry_after_ms))
        why = reason if kind is Kind.PERMANENT else "attempts_exhausted"
        return Decision(Outcome.DEAD_LETTER, reason=why)


def parse_retry_after(value: str | None, now_s: float) -> int | None:
    """``Retry-After`` as milliseconds from now: delta-seconds or an HTTP date.

    Delta-seconds are ASCII digits only (``str.isdigit`` would take ``²`` or ``①``, which
    ``int`` then refuses); any number above the cap is the cap, however many digits it has.
    Anything that is neither form is ignored (None: the schedule applies); a date in the
    past means 0. Never raises: a consumer's header must not change the attempt's outcome.
    """
    if not isinstance(value, str):
        return None
    text = value.strip(" \t")
    if _DELTA_SECONDS.fullmatch(text):
        significant = text.lstrip("0") or "0"
        if len(significant) > len(str(_CAP_S)):
            return RETRY_AFTER_CAP_MS
        return min(int(significant), _CAP_S) * 1000
    when = parse_http_date(text)
    if when is None:
        return None
    return max(0, min(int((when - now_s) * 1000), RETRY_AFTER_CAP_MS))


def parse_http_date(value: str | None) -> float | None:
    """An HTTP date (``Retry-After``, ``Date``) as unix seconds; None for anything that is
    not one with a time zone. Never raises, whatever the text."""
    if not isinstance(value, str) or not value.strip() or len(value) > _MAX_DATE_CHARS:
        return None
    try:
        when = parsedate_to_datetime(value.strip())
        if when is None or when.tzinfo is None:
            return None
        return when.timestamp()
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
