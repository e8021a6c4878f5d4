"""The egress hold (egress.py): one probe at a time while the proxy fails, holds that
grow with the outage and are spread, and the first answer through the proxy ends it."""

from __future__ import annotations

from fluxora_webhooks.egress import HOLD_MAX_S, HOLD_MIN_S, PROBE_S, EgressHold


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
