"""The delivery gate: what the dispatcher asks before and tells after a batch of attempts.

The dispatcher asks once per batch (one Redis round trip for the whole batch on a single
Redis node; one per URL on a Redis Cluster, whose URLs live in different slots) and reports
once per batch. The Redis implementation (rate limit + circuit breaker) is
:class:`~fluxora_webhooks.redis_gate.RedisGate`; :class:`OpenGate` admits everything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Literal, Protocol, TypeAlias


class AdmitCode(IntEnum):
    """The decision for one attempt, as the admit script returns it (``lua/admit.lua``
    receives these names as constants, so both sides share one definition)."""

    ALLOWED = 0
    PROBE = 1  # allowed, as the single half-open probe of a breaker
    RATE_LIMITED = 2
    CIRCUIT_OPEN = 3
    ALLOWED_CLEAN = 4  # allowed, the breaker closed with no failure on record


# What an attempt says of its consumer, for the breaker: True delivered, False a retryable
# failure, ANSWERED a permanent one the consumer answered (a 4xx, a 3xx: it is up), None no
# word of it (refused before connecting, held at the egress proxy or the resolver).
ANSWERED: Literal["answered"] = "answered"
Signal: TypeAlias = bool | Literal["answered"] | None


@dataclass(frozen=True, slots=True)
class Admission:
    """The gate's decision for one pending attempt.

    ``allowed`` False means: do not send; defer the row by ``delay_ms`` (from the
    database's now) without consuming an attempt. ``reason`` is ``rate_limited`` or
    ``circuit_open``. ``probe`` marks the single half-open probe of a breaker. ``clean``:
    allowed while the breaker was closed with no failure on record, so that a success
    reported for it would change nothing (a hint, not part of the decision: not compared).
    """

    allowed: bool
    delay_ms: int = 0
    reason: str = ""
    probe: bool = False
    probe_token: str = ""
    clean: bool = field(default=False, compare=False)


ALLOW = Admission(True)
# Allowed while the breaker was closed with no failure on record.
ALLOW_CLEAN = Admission(True, clean=True)


@dataclass(frozen=True, slots=True)
class AdmitRequest:
    """One URL's pending attempts of a batch (see :meth:`DeliveryGate.admit`)."""

    url: str
    attempts: Sequence[int]
    limit: int | None = None


class DeliveryGate(Protocol):
    async def admit(
        self, url: str, attempts: Sequence[int], *, limit: int | None = None
    ) -> list[Admission]:
        """One decision per pending attempt, in order. ``attempts[i]`` is the attempt number
        (1 is a first attempt, greater is a retry); ``limit`` the URL's retry limit (None:
        the gate's default)."""
        ...

    async def admit_many(self, requests: Sequence[AdmitRequest]) -> list[list[Admission]]:
        """:meth:`admit` for several URLs at once (a batch's), in order: one round trip
        where the gate can."""
        ...

    async def report(self, url: str, results: Sequence[tuple[Admission, Signal]]) -> None:
        """After the attempts that were allowed, what each said of the consumer
        (:data:`Signal`): a half-open breaker's probe closes it when the consumer answered,
        delivered or not."""
        ...

    async def close(self) -> None: ...


class OpenGate:
    """Admits every attempt: no rate limit, no breaker."""

    async def admit(
        self, url: str, attempts: Sequence[int], *, limit: int | None = None
    ) -> list[Admission]:
        return [ALLOW] * len(attempts)

    async def admit_many(self, requests: Sequence[AdmitRequest]) -> list[list[Admission]]:
        return [[ALLOW] * len(r.attempts) for r in requests]

    async def report(self, url: str, results: Sequence[tuple[Admission, Signal]]) -> None:
        return None

    async def close(self) -> None:
        return None
