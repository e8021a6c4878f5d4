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
from collections.abc import Callable
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from enum import Enum

from .outbox import Outcome

RETRY_AFTER_CAP_MS = 24 * 3_600_000
JITTER = 0.20


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

    Invalid values are ignored (None); a date in the past means 0.
    """
    if value is None:
        return None
    text = value.strip()
    if text.isdigit():
        return min(int(text), RETRY_AFTER_CAP_MS // 1000) * 1000
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None or when.tzinfo is None:
        return None
    return max(0, int((when.timestamp() - now_s) * 1000))
