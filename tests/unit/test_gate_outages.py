"""The gate's fail-open bookkeeping (redis_gate._Outages), on a clock of the test's own: a
failing Redis node is left alone for the back-off and said once; slots a cluster node
refuses (a migration) fail open one by one, are said once per node, and hold up neither
that node's other slots nor other nodes; nothing is kept once every place answers."""

from __future__ import annotations

import logging

import pytest

from fluxora_webhooks.redis_gate import _Outages

LOGGER = "fluxora_webhooks.redis_gate"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def outages(clock: Clock, caplog: pytest.LogCaptureFixture) -> _Outages:
    """A second's back-off on the test's clock, Redis's password "pw-secret", logs kept."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    return _Outages(1.0, clock, "pw-secret")


def said(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == LOGGER]


def test_a_node_is_left_alone_for_the_back_off_and_said_once(
    clock: Clock, outages: _Outages, caplog: pytest.LogCaptureFixture
) -> None:
    assert outages.should_try("a:1", 5) and not outages.down
    outages.failed("a:1", None, ConnectionError("refused, password pw-secret"))
    assert outages.down
    assert not outages.should_try("a:1", 5)  # the node's back-off
    assert outages.should_try("b:2", 7)  # another node is asked as before
    clock.now += 1.5
    assert outages.should_try("a:1", 5)  # one caller tries...
    assert not outages.should_try("a:1", 6)  # ...the others keep failing open meanwhile
    outages.failed("a:1", None, ConnectionError("refused"))
    outages.answered("a:1", 5)
    assert not outages.down
    levels = [level for level, _ in said(caplog)]
    assert levels == ["WARNING", "INFO"]  # one outage, said once each way
    assert "pw-secret" not in said(caplog)[0][1] and "at a:1" in said(caplog)[0][1]


def test_refused_slots_fail_open_alone_and_are_said_once_per_node(
    clock: Clock, outages: _Outages, caplog: pytest.LogCaptureFixture
) -> None:
    for slot in range(200):  # a reshard moving many slots off a node
        outages.failed("a:1", slot, RuntimeError("TRYAGAIN"))
    assert not outages.should_try("a:1", 3)
    assert outages.should_try("a:1", 5000)  # the node's other slots are protected
    assert outages.should_try("b:2", 3)  # and other nodes
    clock.now += 1.5
    for slot in range(200):
        assert outages.should_try("a:1", slot)
        outages.answered("a:1", slot)
    assert not outages.down
    assert [level for level, _ in said(caplog)] == ["WARNING", "INFO"]


def test_a_slot_still_waiting_does_not_use_up_its_nodes_try(
    clock: Clock, outages: _Outages
) -> None:
    outages.failed("a:1", None, ConnectionError())
    clock.now += 0.6
    outages.failed("a:1", 9, RuntimeError("TRYAGAIN"))  # slot due at 101.6 + ...
    clock.now += 0.6  # the node is due again, slot 9 is not
    assert not outages.should_try("a:1", 9)
    assert outages.should_try("a:1", 10)  # the node's try was still there for another slot
