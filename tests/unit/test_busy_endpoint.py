"""A row of an endpoint at its concurrency: a fast endpoint's comes back at once, a slow
one's waits for one of its requests to end (after the time its requests take, its timeout
at the latest), and its backlog comes back no faster than it can take it, taking no claim
capacity meanwhile (SPEC 11)."""

from __future__ import annotations

import itertools
import time
from typing import Any, cast

import pytest

from fluxora_webhooks.batch import Batch, Send
from fluxora_webhooks.dispatcher import BUSY_DEFER_S, SLOW_HORIZON_TIMEOUTS, Dispatcher
from tests.support.dispatch import make_settings


def _dispatcher() -> Dispatcher:
    return Dispatcher(
        make_settings("http://127.0.0.1:9/hook", endpoint_concurrency=2, timeout_ms=15_000),
        conninfo="",
    )


def test_an_endpoint_below_its_concurrency_takes_the_row() -> None:
    dispatcher = _dispatcher()
    target = dispatcher.targets.get("default")
    assert target is not None
    target.load.in_flight = 1
    assert dispatcher.capacity_wait_s(target) is None


def test_a_busy_fast_endpoint_defers_briefly_not_until_a_timeout() -> None:
    dispatcher = _dispatcher()
    target = dispatcher.targets.get("default")
    assert target is not None
    target.load.in_flight = 2
    target.load.starts = [time.monotonic(), time.monotonic()]
    assert dispatcher.capacity_wait_s(target) == BUSY_DEFER_S


def test_a_busy_slow_endpoint_waits_for_its_next_request_to_end() -> None:
    dispatcher = _dispatcher()
    target = dispatcher.targets.get("default")
    assert target is not None
    target.load.in_flight = 2
    target.load.starts = [time.monotonic() - 3.0, time.monotonic()]
    target.load.typical_s = 15.0  # its requests time out
    target.load.mark_slow()
    waits = [dispatcher.capacity_wait_s(target) for _ in range(200)]
    assert all(w is not None for w in waits)
    spread = [w for w in waits if w is not None]
    # Not before its first request ends (12 s), and never beyond the horizon.
    horizon = SLOW_HORIZON_TIMEOUTS * 15.0
    assert all(11.0 < w <= horizon for w in spread)
    # The first rows come back one after the other, one slot's share of a timeout apart
    # (2 slots per 15 s: 7.5 s), as fast as the endpoint can take them and no faster...
    paced = spread[:6]
    assert paced == sorted(paced) and paced[-1] - paced[0] > 5 * 7.5 - 7.5
    # ...and the rest, beyond the horizon, spread over it, not all at the same moment.
    rest = spread[10:]
    assert max(rest) - min(rest) > 20.0


def test_a_rolled_back_batch_gives_back_each_slot_it_still_holds_once() -> None:
    """Two rows planned to one endpoint, each taking a slot; one was withheld (the requests
    detached from their batches held their share), giving its slot back then, the other
    never sent. The batch rolls back: the endpoint has both slots again, not three."""
    dispatcher = _dispatcher()
    target = dispatcher.targets.get("default")
    assert target is not None
    target.load.in_flight = 2  # reserved by the plan
    never_sent = Send(cast(Any, None), target, cast(Any, None))
    withheld = Send(cast(Any, None), target, cast(Any, None), withheld=True)
    target.load.release()  # what withholding it did
    batch = Batch(dispatcher)
    batch.sends = [never_sent, withheld]
    dispatcher.after_rollback(batch)
    assert target.load.in_flight == 0


def test_a_slow_endpoint_that_answers_is_paced_by_its_request_time_not_its_timeout() -> None:
    """An endpoint whose requests take 0.4 s is "slow" (they outlive their batches), but its
    rows come back as its requests end: after about 0.4 s, one slot's share of that apart."""
    dispatcher = _dispatcher()
    target = dispatcher.targets.get("default")
    assert target is not None
    load = target.load
    for _ in range(5):
        load.ended(0.4)
    assert load.typical_s == pytest.approx(0.4)
    now = time.monotonic()
    load.in_flight = 2
    load.starts = [now - 0.1, now - 0.3]  # started 0.1 and 0.3 s ago
    load.mark_slow()
    assert load.expected_s(15.0) == pytest.approx(0.4)
    assert load.next_free_in_s(15.0) == pytest.approx(0.1, abs=0.05)
    waits = [dispatcher.capacity_wait_s(target) for _ in range(6)]
    spread = [w for w in waits if w is not None]
    # The first as the oldest request ends, each later one 0.2 s (0.4 s / 2 slots) after.
    assert len(spread) == 6 and all(w < 2.0 for w in spread)
    assert spread == sorted(spread) and spread[-1] - spread[0] > 4 * 0.2


def test_a_request_running_past_its_endpoints_request_time_may_hang() -> None:
    """Four times its typical time: the endpoint is paced by the timeout again."""
    dispatcher = _dispatcher()
    target = dispatcher.targets.get("default")
    assert target is not None
    load = target.load
    load.ended(0.1)
    now = time.monotonic()
    load.starts = [now - 0.5]  # started 0.5 s ago: five times 0.1 s
    assert load.expected_s(15.0) == 15.0
    assert load.next_free_in_s(15.0) == pytest.approx(14.5, abs=0.05)
    # A timeout counts as the whole timeout in its request time.
    load.ended(15.0)
    assert load.typical_s > 3.0


def test_a_hanging_endpoint_first_seen_is_paced_by_its_timeout() -> None:
    """No request to it has ended yet: nothing tells it from one that answers slowly, so
    each in flight is expected to run to its timeout (its rows deferred meanwhile are
    remembered, to be made due at its first answer), and its backlog is paced by it."""
    dispatcher = _dispatcher()
    target = dispatcher.targets.get("default")
    assert target is not None
    load = target.load
    now = time.monotonic()
    load.in_flight = 2
    load.starts = [now - 3.0, now]  # started 3 s ago and just now
    load.mark_slow()
    assert load.expected_s(15.0) == 15.0
    waits = [dispatcher.capacity_wait_s(target) for _ in range(6)]
    spread = [w for w in waits if w is not None]
    assert len(spread) == 6 and all(11.0 < w <= SLOW_HORIZON_TIMEOUTS * 15.0 for w in spread)
    assert spread == sorted(spread) and spread[-1] - spread[0] > 5 * 7.5 - 7.5
    for i in range(3):
        load.deferred(i, None)
    assert list(load.early) == [0, 1, 2]
    load.ended(0.5)  # its first answer: nothing more is remembered
    load.deferred(3, None)
    assert list(load.early) == [0, 1, 2]


def test_a_request_past_its_typical_time_is_expected_to_run_as_long_again() -> None:
    dispatcher = _dispatcher()
    target = dispatcher.targets.get("default")
    assert target is not None
    load = target.load
    load.ended(0.4)
    now = time.monotonic()
    load.starts = [now - 1.0]  # 1 s in: past 0.4 s, not yet four times it
    assert load.expected_s(15.0) == pytest.approx(2.0, abs=0.05)
    assert load.next_free_in_s(15.0) == pytest.approx(1.0, abs=0.05)
    # Never past its timeout, whatever the guess.
    load.ended(14.0)
    load.starts = [now - 10.0]
    assert load.expected_s(15.0) == 15.0
    # A request that ended at once still counts: 0 is "none ended yet" no more.
    fresh = dispatcher.targets.get("default")
    assert fresh is not None
    fresh.load.typical_s = 0.0
    fresh.load.ended(0.0)
    assert fresh.load.typical_s > 0.0


def test_rows_withheld_by_the_full_share_come_back_as_the_share_frees() -> None:
    """The requests detached from their batches hold their share (half of
    WEBHOOK_MAX_CONNECTIONS: 4 here), each to endpoints that answer in 0.4 s: a slow
    endpoint's rows come back from when the first is expected to end, one every 0.1 s
    (4 per 0.4 s), not all at once nor after a timeout."""
    dispatcher = Dispatcher(
        make_settings("http://127.0.0.1:9/hook", max_connections=8, timeout_ms=15_000),
        conninfo="",
    )
    target = dispatcher.targets.get("default")
    assert target is not None
    target.load.ended(0.4)
    now = time.monotonic()
    for i in range(4):
        send = Send(cast(Any, None), target, cast(Any, None))
        send.started, send.started_at = True, now - 0.1 * i
        dispatcher.completer.detached(send)
    assert dispatcher.slow_share_wait_s(target) is not None
    waits = [dispatcher.slow_share_wait_s(target) for _ in range(20)]
    spread = [w for w in waits if w is not None]
    assert len(spread) == 20
    assert 0.05 < spread[0] < 0.2 + 0.1  # the oldest ends in 0.1 s; jittered in its step
    assert all(b > a - 0.1 for a, b in itertools.pairwise(spread))
    assert 20 * 0.1 - 0.3 < spread[-1] - spread[0] < 20 * 0.1 + 0.2
    assert spread[-1] < 15.0  # nowhere near a timeout
