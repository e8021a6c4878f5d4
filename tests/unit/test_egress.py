"""The egress hold (egress.py): one probe at a time while the proxy fails, holds that
grow with the outage and are spread, and the first answer through the proxy ends it."""

from __future__ import annotations

import pytest

from fluxora_webhooks import egress
from fluxora_webhooks.egress import (
    HOLD_MAX_S,
    HOLD_MIN_S,
    PROBE_S,
    RESOLVER_WINDOW_S,
    EgressHold,
    ResolverWatch,
    zone,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_nothing_is_held_while_the_proxy_works() -> None:
    hold = EgressHold(Clock(), jitter=lambda: 0.0)
    assert hold.wait_ms() is None and hold.since is None


def test_a_failure_holds_the_rest_and_lets_one_probe_through_per_interval() -> None:
    clock = Clock()
    hold = EgressHold(clock, jitter=lambda: 0.0)
    assert hold.failed() == HOLD_MIN_S * 1000  # the failed row's own wait
    assert hold.wait_ms() == HOLD_MIN_S * 1000  # the others wait too
    clock.now += PROBE_S
    assert hold.wait_ms() is None  # one probe...
    assert hold.wait_ms() == HOLD_MIN_S * 1000  # ...at a time
    hold.answered()
    assert hold.wait_ms() is None and hold.wait_ms() is None


def test_the_hold_grows_with_the_outage_up_to_its_cap_and_is_spread() -> None:
    clock = Clock()
    hold = EgressHold(clock, jitter=lambda: 0.0)
    hold.failed()
    clock.now += 60
    assert hold.failed() == 60_000
    clock.now += 3600
    assert hold.failed() == HOLD_MAX_S * 1000
    spread = EgressHold(clock, jitter=lambda: 0.999)
    assert spread.failed() > HOLD_MIN_S * 1000 * 1.19


def test_the_end_of_an_outage_says_how_long_it_lasted_and_how_long_a_held_row_may_wait() -> None:
    clock = Clock()
    hold = EgressHold(clock, jitter=lambda: 0.5)
    assert hold.answered() is None  # it was not failing
    hold.failed()
    clock.now += 90
    longest_ms = hold.failed()  # held for the outage so far, spread
    clock.now += 30
    assert hold.wait_ms() is None  # the probe, which gets an answer
    assert hold.answered() == (120.0, longest_ms / 1000)
    assert longest_ms == 99_000  # 90 s, lengthened by half the jitter
    assert hold.answered() is None and hold.since is None
    hold.failed()  # the next outage starts from the shortest hold again
    assert hold.answered() == (0.0, int(HOLD_MIN_S * 1.1 * 1000) / 1000)


def test_the_rows_held_in_an_outage_are_handed_back_once_and_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the dispatcher makes due at once when the proxy answers again."""
    monkeypatch.setattr(egress, "MAX_REMEMBERED", 3)
    hold = EgressHold(Clock(), jitter=lambda: 0.0)
    hold.failed()
    for row_id in range(5):
        hold.remember(row_id, None)
    assert hold.answered() is not None
    assert hold.take_held() == {0: None, 1: None, 2: None}  # the first 3 remembered
    assert hold.take_held() == {}  # handed back once


def test_the_resolver_fails_only_when_names_of_two_zones_that_resolved_fail_none_answered() -> None:
    clock = Clock()
    watch = ResolverWatch(clock, jitter=lambda: 0.0)
    assert not watch.failed("never.example", watch.now())  # never resolved: nothing to compare
    for name in ("a.one.example", "b.one.example", "c.two.example"):
        watch.answered(name)
    clock.now += 1
    assert not watch.failed("a.one.example", watch.now())  # one zone's own servers, maybe
    assert not watch.failed("b.one.example", watch.now())  # the same zone: still one
    assert not watch.holding()
    watch.answered()  # another lookup got an answer ("no such name" too): it works
    clock.now += 1
    assert not watch.failed("c.two.example", watch.now())
    clock.now += RESOLVER_WINDOW_S + 1  # too long ago to go with the next one
    assert not watch.failed("a.one.example", watch.now())
    assert watch.failed("c.two.example", watch.now())  # two zones, none answered: the resolver
    assert watch.hold.since == clock.now
    assert watch.failed("never.example", watch.now())  # while it lasts, every failure is its


def test_a_lookup_begun_before_an_answer_is_no_sign() -> None:
    clock = Clock()
    watch = ResolverWatch(clock, jitter=lambda: 0.0)
    for name in ("a.one.example", "c.two.example"):
        watch.answered(name)
    began = watch.now()
    clock.now += 1
    watch.answered("d.three.example")  # answered while the other two were waiting
    clock.now += 4
    assert not watch.failed("a.one.example", began)
    assert not watch.failed("c.two.example", began)
    assert watch.hold.since is None


def test_while_the_resolver_fails_one_lookup_goes_through_per_interval_and_an_answer_ends_it() -> (
    None
):
    clock = Clock()
    watch = ResolverWatch(clock, jitter=lambda: 0.0)
    for name in ("a.one.example", "b.two.example"):
        watch.answered(name)
    clock.now += 1
    for name in ("a.one.example", "b.two.example"):
        watch.failed(name, watch.now())
    assert watch.holding() and watch.holding()  # not tried
    assert watch.hold.held_ms() == HOLD_MIN_S * 1000
    clock.now += PROBE_S
    assert not watch.holding()  # the probe...
    late = watch.now()  # (a lookup that waits past the answer below)
    assert watch.holding()  # ...one at a time
    assert watch.ended is None
    clock.now += 10
    watch.answered("c.three.example")
    assert watch.take_ended() == (10 + PROBE_S, HOLD_MIN_S)
    assert watch.take_ended() is None and not watch.holding()
    # A lookup begun in the outage that fails after its end is held, and begins no hold.
    clock.now += 3
    assert watch.failed("a.one.example", late) and watch.hold.since is None
    assert not watch.failed("a.one.example", watch.now())  # a new outage needs two zones


def test_the_names_remembered_are_bounded() -> None:
    clock = Clock()
    watch = ResolverWatch(clock)
    for i in range(egress.MAX_KNOWN_HOSTS + 1):
        watch.answered(f"h{i}.example")
    watch.answered("h1.example")  # resolved again: kept as recent
    watch.answered("new.example")
    clock.now += 1
    # The least recently resolved were forgotten: their failures compare with nothing.
    assert not watch.failed("h0.example", watch.now())
    assert not watch.failed("h2.example", watch.now())
    assert not watch.failed("h1.example", watch.now())
    assert watch.failed("h3.example", watch.now())


def test_a_zone_is_a_names_last_two_labels() -> None:
    assert zone("hooks.acme.example") == zone("api.acme.example.") == "acme.example"
    assert zone("acme.example") == "acme.example" and zone("localhost") == "localhost"
