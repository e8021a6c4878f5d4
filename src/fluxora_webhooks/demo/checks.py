"""The demo's checks: each step claims something, and each claim is checked against what
the consumers saw, what the writers committed and what the database holds. A check that
fails makes the demo fail (exit code 1).

Every function here is a pure function of those facts (the runner gathers them), so the
rules are written once and read in one place.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from .cast import Part, subscribes
from .consumer import Consumer, EventKey, HoldBack, verifies_with
from .streams import Committed, Ledger


@dataclass(frozen=True)
class Check:
    """One claim of a step and whether it held; ``detail`` gives the figures."""

    claim: str
    ok: bool
    detail: str = ""


@dataclass(frozen=True)
class Percentiles:
    p50: float
    p95: float
    p99: float
    count: int


def percentiles(seconds: Sequence[float]) -> Percentiles | None:
    """p50/p95/p99 in milliseconds (nearest rank), None for no values."""
    if not seconds:
        return None
    ordered = sorted(max(0.0, s) * 1000 for s in seconds)

    def rank(p: int) -> float:
        return ordered[max(0, math.ceil(p * len(ordered) / 100) - 1)]

    return Percentiles(rank(50), rank(95), rank(99), len(ordered))


def ms(value: float) -> str:
    return f"{value:.1f} ms" if value < 10 else f"{value:.0f} ms"


def expected(part: Part, events: Iterable[Committed]) -> set[EventKey]:
    """The events ``part`` must receive: its tenant's, of a type it subscribes to."""
    return {
        e.key for e in events if e.tenant == part.tenant and subscribes(part.events, e.event_type)
    }


def received(consumer: Consumer, keys: Iterable[EventKey] | None = None) -> set[EventKey]:
    """The events the consumer accepted (among ``keys``, when given)."""
    got = {a.key for a in consumer.accepted.values()}
    return got if keys is None else got & set(keys)


def latencies(ledger: Ledger, consumers: Iterable[Consumer], keys: set[EventKey]) -> list[float]:
    """Commit to first receipt, in seconds, of every delivery of these events."""
    out = []
    for consumer in consumers:
        for delivery_id, at in consumer.first_seen.items():
            key = consumer.seen.get(delivery_id)
            if key in keys and key in ledger.committed:
                out.append(at - ledger.committed[key].committed_at)
    return out


# -- step 1: fan-out ------------------------------------------------------------------------


def fan_out(events: Sequence[Committed], cast: Mapping[Part, Consumer]) -> list[Check]:
    """Each event reached every endpoint of its tenant that subscribes to it, and no other;
    each (event, endpoint) pair with one delivery id of its own."""
    keys = {e.key for e in events}
    tenant_of = {e.key: e.tenant for e in events}
    missing = wrong = across = deliveries = 0
    pairs_with_two_ids = 0
    ids: dict[str, int] = {}
    for part, consumer in cast.items():
        want = expected(part, events)
        got = received(consumer, keys)
        deliveries += len(got & want)
        missing += len(want - got)
        wrong += len(got - want)
        across += sum(1 for k in got if tenant_of[k] != part.tenant)
        per_key: dict[EventKey, set[str]] = {}
        for delivery_id, accepted in consumer.accepted.items():
            if accepted.key in keys:
                per_key.setdefault(accepted.key, set()).add(delivery_id)
                ids[delivery_id] = ids.get(delivery_id, 0) + 1
        pairs_with_two_ids += sum(1 for s in per_key.values() if len(s) > 1)
    shared = sum(1 for n in ids.values() if n > 1)
    return [
        Check(
            "every event reached each endpoint of its tenant that subscribes to its type",
            missing == 0 and deliveries > 0,
            f"{len(events)} events -> {deliveries} deliveries to {len(cast)} endpoints"
            + (f"; {missing} missing" if missing else ""),
        ),
        Check(
            "no event reached another tenant's endpoint, or one not subscribed to it",
            wrong == 0,
            f"{across} to another tenant, {wrong - across} outside a subscription",
        ),
        Check(
            "each (event, endpoint) pair has its own delivery id",
            pairs_with_two_ids == 0 and shared == 0,
            f"{len(ids)} delivery ids, {shared} shared between endpoints,"
            f" {pairs_with_two_ids} pairs with two",
        ),
    ]


def own_secrets(cast: Mapping[Part, Consumer]) -> Check:
    """Each endpoint's deliveries verify with its own secret and with no other's: one
    request of every endpoint that received any is tried with every other secret."""
    crossed = sampled = 0
    for part, consumer in cast.items():
        if consumer.sample is None:
            continue  # nothing it subscribes to was written yet
        sampled += 1
        body, headers = consumer.sample
        for other_part, other in cast.items():
            if other_part != part and verifies_with(body, headers, other.secret):
                crossed += 1
    failures = sum(c.signature_failures for c in cast.values())
    return Check(
        "each endpoint's consumer verifies with its own secret; no other secret fits",
        sampled >= 2 and crossed == 0 and failures == 0,
        f"requests of {sampled} endpoints tried with the {len(cast) - 1} other secrets:"
        f" {crossed} verified; {failures} failures",
    )


# -- step 2: isolation and auto-disable -----------------------------------------------------


def isolation(
    ledger: Ledger,
    healthy: Mapping[Part, Consumer],
    events: Sequence[Committed],
    *,
    down: Consumer,
    timeout_ms: int,
    before: Percentiles | None,
) -> Check:
    """While one endpoint hangs, the others receive everything, and never wait for its
    timeout. Latency is measured at the unordered endpoints (an ordered endpoint's event
    waits for the previous one of its stream by design)."""
    keys = {e.key for e in events}
    missing = sum(len(expected(p, events) - received(c, keys)) for p, c in healthy.items())
    p = percentiles(latencies(ledger, unordered(healthy), keys))
    if p is None:
        return Check("the other endpoints kept receiving", False, "no healthy delivery")
    was = "" if before is None else f"; before: p50 {ms(before.p50)}, p99 {ms(before.p99)}"
    return Check(
        f"the other endpoints kept receiving, never waiting for its {timeout_ms} ms timeout",
        missing == 0 and down.hung > 0 and p.p99 < timeout_ms,
        f"{down.hung} requests hung at {down.name}; the others from commit: p50"
        f" {ms(p.p50)}, p99 {ms(p.p99)}{was}" + (f"; {missing} missing" if missing else ""),
    )


def unordered(cast: Mapping[Part, Consumer]) -> list[Consumer]:
    return [c for p, c in cast.items() if not p.ordered]


def auto_disabled(
    endpoint: Any,
    *,
    disable_after_ms: int,
    parked: int,
    owed: int,
    dead_letters: int,
) -> list[Check]:
    """Disabled as failing after the failure streak; its deliveries parked, none dropped.
    ``endpoint`` is the registry's :class:`~fluxora_webhooks.endpoints.Endpoint`; ``owed``
    the deliveries its consumer has not accepted."""
    disabled_at: datetime | None = endpoint.disabled_at
    since: datetime | None = endpoint.failing_since
    streak_s = (
        disabled_at.timestamp() - since.timestamp()  # not on the wall clock (DST)
        if disabled_at is not None and since is not None
        else None
    )
    streak = "" if streak_s is None else f" {streak_s:.1f} s after its first failure"
    return [
        Check(
            f"auto-disabled after failing for {disable_after_ms / 1000:g} s"
            " (WEBHOOK_DISABLE_AFTER)",
            endpoint.state == "disabled"
            and endpoint.disabled_reason == "failing"
            and streak_s is not None
            and streak_s >= disable_after_ms / 1000,
            f"state {endpoint.state}, reason {endpoint.disabled_reason}{streak}",
        ),
        Check(
            "its deliveries are parked (kept, not attempted), none dead-lettered",
            parked == owed and parked > 0 and dead_letters == 0,
            f"{parked} parked of {owed} not delivered, {dead_letters} dead letters",
        ),
    ]


def operator_told(
    operator: Consumer, event_type: str, *, endpoint_id: str, tenant: str, reason: str | None
) -> Check:
    """The operator received ``event_type`` about the endpoint, signed with its secret."""
    found = [
        a.payload
        for a in operator.accepted.values()
        if a.event_type == event_type
        and isinstance(a.payload, dict)
        and a.payload.get("endpoint_id") == endpoint_id
    ]
    ok = any(p.get("tenant") == tenant and p.get("reason") == reason for p in found)
    shown = f" ({reason})" if reason else ""
    return Check(
        f"the operator was sent {event_type}{shown}, signed with the operator secret",
        ok and operator.signature_failures == 0,
        f"{len(found)} received at WEBHOOK_OPERATOR_URL",
    )


# -- step 3: back ---------------------------------------------------------------------------


def resumed(parked_ids: set[str], consumer: Consumer, state: str) -> Check:
    """Enabling sent every parked delivery, under the delivery id it had."""
    delivered = parked_ids & consumer.accepted.keys()
    return Check(
        "enabled again: every parked delivery delivered, with its own delivery id",
        state == "enabled" and bool(parked_ids) and delivered == parked_ids,
        f"{len(delivered)}/{len(parked_ids)} parked deliveries received",
    )


# -- step 4: recovery -----------------------------------------------------------------------


def dead_lettered(
    dead_ids: set[str], owed: set[EventKey], consumer: Consumer, operator: Consumer
) -> list[Check]:
    """What the rejecting endpoint refused became dead letters, the rest was delivered,
    and the operator heard of each dead letter. ``owed``: the events it had to receive."""
    told = {
        str(a.payload.get("delivery_id"))
        for a in operator.accepted.values()
        if a.event_type == "delivery.dead_lettered" and isinstance(a.payload, dict)
    }
    passed = received(consumer, owed)
    rejected = {consumer.seen[d] for d in dead_ids if d in consumer.seen}
    return [
        Check(
            "each rejected delivery became a dead letter (a 4xx is permanent), the others"
            " were delivered",
            bool(dead_ids)
            and dead_ids == consumer.rejected.keys()
            and rejected | passed == owed
            and not rejected & passed,
            f"{len(dead_ids)} dead letters, {len(passed)} delivered, of {len(owed)}",
        ),
        Check(
            "the operator was sent delivery.dead_lettered for each",
            bool(dead_ids) and dead_ids <= told,
            f"{len(dead_ids & told)}/{len(dead_ids)} received at WEBHOOK_OPERATOR_URL",
        ),
    ]


def recovered(dead_ids: set[str], requeued: int, consumer: Consumer, left: int) -> Check:
    delivered = dead_ids & consumer.accepted.keys()
    return Check(
        "recover re-queued them in one call; delivered with the same delivery ids",
        requeued == len(dead_ids) > 0 and delivered == dead_ids and left == 0,
        f"{requeued} re-queued, {len(delivered)}/{len(dead_ids)} delivered, {left} still dead",
    )


# -- step 5: ordering -----------------------------------------------------------------------


def ordering(
    consumer: Consumer, held: HoldBack, streams: Sequence[str], events: Sequence[Committed]
) -> list[Check]:
    """A retrying head delays its own stream and no other; each stream in order."""
    by_stream: dict[str, list[tuple[float, int]]] = {s: [] for s in streams}
    for accepted in consumer.accepted.values():
        payload = accepted.payload
        if isinstance(payload, dict) and payload.get("id") in by_stream:
            by_stream[str(payload["id"])].append((accepted.at, int(payload["version"])))
    start, end = held.first_refused_at, held.accepted_at
    during = delivered_while_held(consumer, held, streams)
    mine = sorted(by_stream[held.stream])
    in_order = all(
        [v for _, v in sorted(by_stream[s])] == sorted(v for _, v in by_stream[s]) for s in streams
    )
    planned = sum(1 for e in events if e.stream_id == held.stream)
    waited = (
        end is not None and len(mine) == planned > 1 and all(at >= end for at, v in mine if v > 1)
    )
    held_s = f" for {end - start:.2f} s" if start is not None and end is not None else ""
    return [
        Check(
            "a retrying head delays only its own stream",
            held.refused == held.times and end is not None and during > 0,
            f"{held.stream}'s head answered 503 {held.refused} times{held_s};"
            f" meanwhile {during} events of the other {len(streams) - 1} streams delivered",
        ),
        Check(
            "its later events waited for it, and every stream arrived in order",
            waited and in_order and not consumer.order_violations,
            f"{len(mine)} events of {held.stream} after its head;"
            f" {len(consumer.order_violations)} out of order",
        ),
    ]


def delivered_while_held(consumer: Consumer, held: HoldBack, streams: Sequence[str]) -> int:
    """The other streams' events accepted while the held stream's head was retrying."""
    start, end = held.first_refused_at, held.accepted_at
    if start is None or end is None:
        return 0
    others = set(streams) - {held.stream}
    return sum(
        1
        for a in consumer.accepted.values()
        if isinstance(a.payload, dict) and a.payload.get("id") in others and start <= a.at <= end
    )


# -- the whole run --------------------------------------------------------------------------


def whole_run(
    ledger: Ledger,
    cast: Mapping[Part, Consumer],
    operator: Consumer,
    *,
    pending: int,
    dead: int,
    table_agrees: bool,
) -> list[Check]:
    checks = fan_out(list(ledger.committed.values()), cast)[:1]
    received_keys = {k for c in cast.values() for k in c.seen.values()}
    from_rolled_back = len(received_keys & ledger.rolled_back)
    unknown = len(received_keys - ledger.committed.keys() - ledger.rolled_back)
    failures = sum(c.signature_failures for c in (*cast.values(), operator))
    violations = sum(len(c.order_violations) for c in cast.values())
    duplicates = sum(c.duplicates for c in cast.values())
    reasons = [r for c in (*cast.values(), operator) for r in c.failure_reasons][:1]
    checks += [
        Check(
            "nothing from a rolled-back write was sent; every body as committed",
            from_rolled_back == 0 and unknown == 0,
            f"{len(ledger.rolled_back)} writes rolled back, {from_rolled_back} of them"
            f" received, {unknown} unknown or altered",
        ),
        Check(
            "every request's signature verified (both schemes, standardwebhooks too)",
            failures == 0,
            f"{failures} failures"
            + (f" (first: {reasons[0]})" if reasons else "")
            + f"; {duplicates} duplicates de-duplicated by delivery id",
        ),
        Check(
            "the ordered endpoint never received a stream's event before the previous one",
            violations == 0,
            f"{violations} out of order",
        ),
        Check(
            "nothing left pending or dead; demo_streams agrees with the committed events",
            pending == 0 and dead == 0 and table_agrees,
            f"{pending} pending, {dead} dead letters"
            + ("" if table_agrees else "; demo_streams disagrees"),
        ),
    ]
    return checks
