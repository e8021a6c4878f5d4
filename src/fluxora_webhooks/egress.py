"""The egress proxy's health as one dispatcher process sees it (``WEBHOOK_PROXY_URL``).

When the proxy fails (it cannot be reached, gives no usable answer to ``CONNECT``, or
refuses this service's user and password), no consumer was asked: the attempt says nothing
of its endpoint. Such a row is deferred with its attempt unused (batch.outcome_of), and
while the proxy keeps failing the process holds its other https rows without a request,
letting one through every PROBE_S to see whether the proxy is back. The hold grows with the
outage, from HOLD_MIN_S to HOLD_MAX_S (the breaker's default reset), so a long outage costs
a claim per row every few minutes, not a connection attempt per row every few seconds; the
first request through the proxy that gets any answer ends it, and the rows this process
held (up to MAX_REMEMBERED) are made due at once; those held by other processes go as
their own processes see the proxy answer, or when their holds end.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from datetime import datetime

PROBE_S = 2.0
HOLD_MIN_S = 5.0
HOLD_MAX_S = 300.0
JITTER = 0.2  # a hold is lengthened by up to this fraction, so held rows come back spread
# How many held rows (id, partition_at) a process remembers, to make them due again at once
# when the proxy answers; past this many they go when their holds end.
MAX_REMEMBERED = 20_000


class EgressHold:
    """Whether this process's requests through the proxy are held, and for how long."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self._clock = clock
        self._jitter = jitter
        self.since: float | None = None  # when the proxy began failing; None: it works
        self._probe_at = 0.0
        self._longest_ms = 0  # the longest hold given in this outage
        self._held: dict[int, datetime | None] = {}  # rows held in this outage

    def failed(self) -> int:
        """A request failed at the proxy: the hold begins (or goes on). Returns how long
        that request's row waits, in milliseconds."""
        now = self._clock()
        if self.since is None:
            self.since = now
            self._probe_at = now + PROBE_S
        return self._hold_ms(now)

    def remember(self, row_id: int, partition_at: datetime | None) -> None:
        """A row was held (its id and partition): made due again when the proxy answers."""
        if len(self._held) < MAX_REMEMBERED:
            self._held[row_id] = partition_at

    def take_held(self) -> dict[int, datetime | None]:
        """The rows held in the outage that has ended (see :meth:`answered`), once."""
        held, self._held = self._held, {}
        return held

    def answered(self) -> tuple[float, float] | None:
        """A request through the proxy got an answer (any, the consumer's): it works.
        Returns how long it had failed and the longest hold given meanwhile (what a held
        row may still wait), in seconds; None when it was not failing."""
        if self.since is None:
            return None
        ended = (max(0.0, self._clock() - self.since), self._longest_ms / 1000)
        self.since = None
        self._longest_ms = 0
        return ended

    def wait_ms(self) -> int | None:
        """None when a request may go now (no hold, or this one is the probe); else how
        long its row is deferred."""
        if self.since is None:
            return None
        now = self._clock()
        if now >= self._probe_at:
            self._probe_at = now + PROBE_S
            return None
        return self._hold_ms(now)

    def _hold_ms(self, now: float) -> int:
        assert self.since is not None
        base = min(HOLD_MAX_S, max(HOLD_MIN_S, now - self.since))
        ms = int(base * (1 + JITTER * self._jitter()) * 1000)
        self._longest_ms = max(self._longest_ms, ms)
        return ms
