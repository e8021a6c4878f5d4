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

The DNS resolver is this service's way out too (:class:`ResolverWatch`): when lookups of
host names that resolved before fail for a while, the resolver is what fails, not the
consumers, and their rows are held the same way until a lookup gets an answer again.
"""

from __future__ import annotations

import math
import random
import time
from collections import OrderedDict
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

    def held_ms(self) -> int:
        """How long a row held now waits, in milliseconds (the shortest hold when none is
        on), without beginning a hold."""
        if self.since is None:
            return int(HOLD_MIN_S * 1000)
        return self._hold_ms(self._clock())

    def _hold_ms(self, now: float) -> int:
        assert self.since is not None
        base = min(HOLD_MAX_S, max(HOLD_MIN_S, now - self.since))
        ms = int(base * (1 + JITTER * self._jitter()) * 1000)
        self._longest_ms = max(self._longest_ms, ms)
        return ms


# Distinct zones (a host name's last two labels), each with a name that resolved before in
# this process, whose lookups must fail within RESOLVER_WINDOW_S (and none get an answer
# since) for the resolver to be the one failing: one zone's own DNS servers failing, however
# many of its names a deployment sends to, is its endpoints' trouble.
RESOLVER_QUORUM = 2
RESOLVER_WINDOW_S = 60.0
MAX_KNOWN_HOSTS = 4096  # names remembered as resolved, the least recently resolved go first


def zone(host: str) -> str:
    """The part of a host name that its DNS servers most likely share: its last two labels
    (``hooks.acme.example`` and ``api.acme.example`` are one; ``co.uk``'s names all one,
    which only makes an outage slower to be believed)."""
    return ".".join(host.rstrip(".").split(".")[-2:])


class ResolverWatch:
    """Whether this process's DNS resolver fails, as its lookups show: shared by the
    dispatcher's HTTP clients (each keeps its own cache of answers).

    A lookup that fails for want of an answer (no answer in time, "temporary failure in
    name resolution") of a name that resolved before is a sign; names of RESOLVER_QUORUM
    zones failing so within RESOLVER_WINDOW_S, with no lookup answered meanwhile, begin a
    hold (:class:`EgressHold`): lookups of names not in a client's cache are held without
    being tried, one every PROBE_S going through to see whether the resolver is back, and
    the rows are deferred with their attempts unused. Any answer of the resolver ends it,
    "no such name" included; one the machine gives itself (``localhost``, from its hosts
    file: the client does not report it) says nothing of the resolver. Then
    :meth:`take_ended` says how long it failed, once. A lookup that began before the last
    answer is no sign: it was answered, or not, by the resolver as it was then."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self._clock = clock
        self.hold = EgressHold(clock, jitter)
        self._known: OrderedDict[str, None] = OrderedDict()
        self._failing: dict[str, float] = {}  # zones of known names whose lookups failed
        self._answered_at = -math.inf  # the last answer of the resolver
        self._ended_at = -math.inf  # when the last hold ended
        # (how long it failed, the longest hold given): set when an answer ends a hold,
        # taken by the dispatcher (which makes the rows it held due at once).
        self.ended: tuple[float, float] | None = None

    def now(self) -> float:
        """When a lookup begins (what :meth:`failed` is told)."""
        return self._clock()

    def holding(self) -> bool:
        """A lookup must not be tried now: the resolver fails, and this is not the
        probe's turn."""
        return self.hold.since is not None and self.hold.wait_ms() is not None

    def answered(self, host: str | None = None) -> None:
        """The resolver answered a lookup (``host``: it resolved, and is remembered as a
        name that does; None: "no such name")."""
        now = self._clock()
        self._answered_at = now
        if host is not None:
            self._known[host] = None
            self._known.move_to_end(host)
            if len(self._known) > MAX_KNOWN_HOSTS:
                self._known.popitem(last=False)
        if self._failing:
            self._failing.clear()
        if self.hold.since is not None:
            self.ended = self.hold.answered()
            self._ended_at = now

    def failed(self, host: str, began: float) -> bool:
        """A lookup of ``host``, begun at ``began`` (:meth:`now`), got no answer. Returns
        whether the resolver is what fails (the row is held, counted against no endpoint);
        False: the name's own trouble, as far as anyone can tell."""
        if self.hold.since is not None:
            return True  # the probe failed too
        if began <= self._ended_at:
            return True  # begun in the outage that has ended since: held, none begun again
        if began <= self._answered_at or host not in self._known:
            return False  # others were answered meanwhile, or nothing to compare with
        now = self._clock()
        for name, at in list(self._failing.items()):
            if now - at > RESOLVER_WINDOW_S:
                del self._failing[name]
        self._failing[zone(host)] = now
        if len(self._failing) < RESOLVER_QUORUM:
            return False
        self.hold.failed()
        return True

    def take_ended(self) -> tuple[float, float] | None:
        """How long the outage that has just ended lasted and the longest hold given,
        once (None: none ended since the last call)."""
        ended, self.ended = self.ended, None
        return ended
