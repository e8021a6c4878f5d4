"""The shared circuit breaker of RedisGate, against the real Redis at 127.0.0.1:6379."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.asyncio import Redis

from fluxora_webhooks.gate import ALLOW, ANSWERED, Admission
from fluxora_webhooks.metrics import REGISTRY
from fluxora_webhooks.redis_gate import (
    CLOSED,
    HALF_OPEN,
    OPEN,
    STATE_IDLE_TTL_MS,
    BreakerState,
    RedisGate,
    breaker_key,
    probe_key,
    rate_limit_key,
    read_breaker_state,
    url_digest,
)
from tests.support import gates
from tests.support.gates import server_ms

pytestmark = pytest.mark.integration

URL = "https://consumer.example/hooks"
TRANSITIONS = "fluxora_webhook_circuit_breaker_transitions_total"


def make_gate(client: Redis, prefix: str, **overrides: Any) -> RedisGate:
    return gates.make_gate(
        client,
        prefix,
        **{
            "retry_rps": 1000,
            "breaker_threshold": 3,
            "breaker_reset_ms": 200,
            "probe_ttl_ms": 10_000,
            **overrides,
        },
    )


async def wait_until_server_ms(client: Redis, target: int) -> None:
    for _ in range(1000):
        now = await server_ms(client)
        if now >= target:
            return
        await asyncio.sleep((target - now) / 1000)
    pytest.fail("the Redis clock never reached the target")


def transitions(from_state: str, to_state: str) -> float:
    labels = {"from_state": from_state, "to_state": to_state}
    return REGISTRY.get_sample_value(TRANSITIONS, labels) or 0.0


async def fail(gate: RedisGate, times: int) -> None:
    """``times`` attempts admitted and reported as retryable failures, one batch each."""
    for _ in range(times):
        admissions = await gate.admit(URL, [1])
        await gate.report(URL, [(admissions[0], False)])


async def open_and_wait(gate: RedisGate, client: Redis) -> BreakerState:
    """Open the circuit and wait until it may be probed; returns the open state."""
    await fail(gate, gate.breaker_threshold)
    state = await read_breaker_state(client, URL, gate.prefix)
    assert state.state == OPEN
    await wait_until_server_ms(client, state.reset_at_ms)
    return state


async def take_probe(gate: RedisGate) -> Admission:
    admissions = await gate.admit(URL, [1])
    assert admissions[0].probe, admissions
    return admissions[0]


async def test_consecutive_failures_open_the_circuit(redis_client: Redis, prefix: str) -> None:
    gate = make_gate(redis_client, prefix, breaker_reset_ms=60_000)
    opened = transitions(CLOSED, OPEN)

    await fail(gate, 2)
    assert await read_breaker_state(redis_client, URL, prefix) == BreakerState(CLOSED, 2)
    assert await gate.admit(URL, [1, 2]) == [ALLOW, ALLOW]

    before = await server_ms(redis_client)
    await fail(gate, 1)
    after = await server_ms(redis_client)

    state = await read_breaker_state(redis_client, URL, prefix)
    assert state.state == OPEN
    assert state.failures == 3
    assert before + 60_000 <= state.reset_at_ms <= after + 60_000
    assert transitions(CLOSED, OPEN) - opened == 1


async def test_an_open_circuit_defers_every_attempt_until_reset_at(
    redis_client: Redis, prefix: str
) -> None:
    gate = make_gate(redis_client, prefix, breaker_reset_ms=60_000)
    await fail(gate, 3)
    reset_at = (await read_breaker_state(redis_client, URL, prefix)).reset_at_ms
    deferrals = REGISTRY.get_sample_value("fluxora_webhook_circuit_open_deferrals_total") or 0.0

    before = await server_ms(redis_client)
    admissions = await gate.admit(URL, [1, 2, 1])
    after = await server_ms(redis_client)

    assert {a.reason for a in admissions} == {"circuit_open"}
    assert not any(a.allowed or a.probe for a in admissions)
    for admission in admissions:
        assert reset_at - after <= admission.delay_ms <= reset_at - before
    total = REGISTRY.get_sample_value("fluxora_webhook_circuit_open_deferrals_total")
    assert total == deferrals + 3
    # Nothing was sent, so nothing was recorded by the rate limit.
    assert await redis_client.zcard(rate_limit_key(URL, prefix)) == 3


async def test_a_success_resets_the_failure_count(redis_client: Redis, prefix: str) -> None:
    gate = make_gate(redis_client, prefix)
    await fail(gate, 2)
    await gate.report(URL, [(ALLOW, True)])
    # Closed with no failures is stored as nothing at all.
    assert await redis_client.exists(breaker_key(URL, prefix)) == 0

    await fail(gate, 2)
    assert await read_breaker_state(redis_client, URL, prefix) == BreakerState(CLOSED, 2)


async def test_successes_admitted_clean_cost_no_report_and_others_are_recorded(
    redis_client: Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Successes admitted while the breaker was closed with no failure change nothing, so
    their report makes no Redis call; a failure, or a success admitted after a failure,
    is recorded as before."""
    gate = make_gate(redis_client, prefix)
    calls: list[str] = []
    call = gate._call

    async def spy(component: str, *args: Any) -> Any:
        calls.append(component)
        return await call(component, *args)

    monkeypatch.setattr(gate, "_call", spy)
    admissions = await gate.admit(URL, [1, 1, 2])
    assert all(a.allowed and a.clean for a in admissions)
    await gate.report(URL, [(a, True) for a in admissions])
    assert calls == ["gate"]  # the admission only
    assert await redis_client.exists(breaker_key(URL, prefix)) == 0

    # A failure among them is recorded, in order with the successes around it.
    admissions = await gate.admit(URL, [1, 1])
    await gate.report(URL, [(admissions[0], False), (admissions[1], True)])
    assert calls[-1] == "breaker"
    assert await redis_client.exists(breaker_key(URL, prefix)) == 0
    await gate.report(URL, [(admissions[0], True), (admissions[1], False)])
    assert await read_breaker_state(redis_client, URL, prefix) == BreakerState(CLOSED, 1)

    # With a failure on record, admissions are not clean: a success is reported and
    # resets the count.
    admitted = await gate.admit(URL, [1])
    assert admitted[0].allowed and not admitted[0].clean
    before = len(calls)
    await gate.report(URL, [(admitted[0], True)])
    assert calls[before:] == ["breaker"]
    assert await redis_client.exists(breaker_key(URL, prefix)) == 0


async def test_none_changes_nothing(redis_client: Redis, prefix: str) -> None:
    gate = make_gate(redis_client, prefix)
    await fail(gate, 2)
    await gate.report(URL, [(ALLOW, None), (ALLOW, None)])
    assert await read_breaker_state(redis_client, URL, prefix) == BreakerState(CLOSED, 2)

    await fail(gate, 1)
    state = await read_breaker_state(redis_client, URL, prefix)
    await gate.report(URL, [(ALLOW, None)])
    assert await read_breaker_state(redis_client, URL, prefix) == state


async def test_one_batch_is_recorded_in_order(redis_client: Redis, prefix: str) -> None:
    gate = make_gate(redis_client, prefix)
    await gate.report(URL, [(ALLOW, False), (ALLOW, False), (ALLOW, True), (ALLOW, False)])
    assert await read_breaker_state(redis_client, URL, prefix) == BreakerState(CLOSED, 1)

    # Refused admissions were not sent: their entries are ignored.
    refused = Admission(False, delay_ms=5, reason="rate_limited")
    await gate.report(URL, [(refused, False), (refused, True)])
    assert await read_breaker_state(redis_client, URL, prefix) == BreakerState(CLOSED, 1)


async def test_after_reset_exactly_one_attempt_probes(redis_client: Redis, prefix: str) -> None:
    gate = make_gate(redis_client, prefix, probe_ttl_ms=5_000)
    await open_and_wait(gate, redis_client)
    half_opened = transitions(OPEN, HALF_OPEN)

    admissions = await gate.admit(URL, [1, 2, 1])

    probe, *others = admissions
    assert probe.allowed and probe.probe and probe.probe_token
    for other in others:
        assert not other.allowed and not other.probe
        assert other.reason == "circuit_open"
        # Deferred while the probe holds its lease: never longer than a reset period.
        assert 0 < other.delay_ms <= 200
    assert transitions(OPEN, HALF_OPEN) - half_opened == 1
    state = await read_breaker_state(redis_client, URL, prefix)
    assert (state.state, state.probe_token) == (HALF_OPEN, probe.probe_token)
    assert await redis_client.get(probe_key(URL, prefix)) == probe.probe_token.encode()
    assert 0 < await redis_client.pttl(probe_key(URL, prefix)) <= 5_000

    # Other callers keep being deferred while the probe is out.
    again = await gate.admit(URL, [1, 1])
    assert [a.reason for a in again] == ["circuit_open", "circuit_open"]
    assert transitions(OPEN, HALF_OPEN) - half_opened == 1


async def test_probe_deferral_lasts_until_the_lease_ends_when_shorter_than_reset(
    redis_client: Redis, prefix: str
) -> None:
    gate = make_gate(redis_client, prefix, breaker_reset_ms=200, probe_ttl_ms=150)
    await open_and_wait(gate, redis_client)
    await take_probe(gate)
    left = await redis_client.pttl(probe_key(URL, prefix))
    [deferred] = await gate.admit(URL, [1])
    assert deferred.reason == "circuit_open"
    assert 0 < deferred.delay_ms <= left


async def test_probe_success_closes_the_circuit(redis_client: Redis, prefix: str) -> None:
    gate = make_gate(redis_client, prefix)
    await open_and_wait(gate, redis_client)
    probe = await take_probe(gate)
    closed = transitions(HALF_OPEN, CLOSED)

    await gate.report(URL, [(probe, True)])

    assert await redis_client.exists(breaker_key(URL, prefix), probe_key(URL, prefix)) == 0
    assert await read_breaker_state(redis_client, URL, prefix) == BreakerState()
    assert transitions(HALF_OPEN, CLOSED) - closed == 1
    assert await gate.admit(URL, [1, 2]) == [ALLOW, ALLOW]


async def test_probe_failure_reopens_with_a_fresh_reset_at(
    redis_client: Redis, prefix: str
) -> None:
    gate = make_gate(redis_client, prefix, breaker_reset_ms=300)
    first = await open_and_wait(gate, redis_client)
    probe = await take_probe(gate)
    reopened = transitions(HALF_OPEN, OPEN)

    before = await server_ms(redis_client)
    await gate.report(URL, [(probe, False)])

    state = await read_breaker_state(redis_client, URL, prefix)
    assert state.state == OPEN
    assert state.probe_token == ""
    assert state.reset_at_ms >= before + 300 > first.reset_at_ms
    assert await redis_client.exists(probe_key(URL, prefix)) == 0
    assert transitions(HALF_OPEN, OPEN) - reopened == 1
    assert [a.reason for a in await gate.admit(URL, [1])] == ["circuit_open"]


async def test_only_the_probe_owner_decides_a_half_open_circuit(
    redis_client: Redis, prefix: str
) -> None:
    gate = make_gate(redis_client, prefix)
    await open_and_wait(gate, redis_client)
    probe = await take_probe(gate)
    expected = await read_breaker_state(redis_client, URL, prefix)

    forged = Admission(True, probe=True, probe_token="not-the-owner")
    unowned = Admission(True, probe=True)
    await gate.report(URL, [(ALLOW, True), (ALLOW, False), (forged, True), (forged, False)])
    await gate.report(URL, [(unowned, True)])

    assert await read_breaker_state(redis_client, URL, prefix) == expected
    assert await redis_client.get(probe_key(URL, prefix)) == probe.probe_token.encode()


async def test_a_crashed_probe_expires_and_a_new_one_takes_over(
    redis_client: Redis, prefix: str
) -> None:
    gate = make_gate(redis_client, prefix, probe_ttl_ms=300)
    await open_and_wait(gate, redis_client)
    crashed = await take_probe(gate)  # never reports

    assert [a.reason for a in await gate.admit(URL, [1])] == ["circuit_open"]
    for _ in range(500):
        if not await redis_client.exists(probe_key(URL, prefix)):
            break
        await asyncio.sleep(0.01)
    else:
        pytest.fail("the probe lease never expired")

    successor = await take_probe(gate)
    assert successor.probe_token != crashed.probe_token
    # The late report of the superseded probe counts for nothing...
    await gate.report(URL, [(crashed, True)])
    state = await read_breaker_state(redis_client, URL, prefix)
    assert (state.state, state.probe_token) == (HALF_OPEN, successor.probe_token)
    # ... the current owner's does.
    await gate.report(URL, [(successor, True)])
    assert await read_breaker_state(redis_client, URL, prefix) == BreakerState()


async def test_a_slow_probe_still_decides_if_nobody_took_over(
    redis_client: Redis, prefix: str
) -> None:
    gate = make_gate(redis_client, prefix, probe_ttl_ms=100)
    await open_and_wait(gate, redis_client)
    probe = await take_probe(gate)
    await asyncio.sleep(0.2)
    assert await redis_client.exists(probe_key(URL, prefix)) == 0

    await gate.report(URL, [(probe, False)])
    assert (await read_breaker_state(redis_client, URL, prefix)).state == OPEN


async def test_a_probe_the_consumer_answered_with_a_4xx_closes_the_circuit(
    redis_client: Redis, prefix: str
) -> None:
    """A 4xx (a permanent failure of that delivery) says the consumer is up: the probe
    closes the breaker, as a 2xx does (it stayed half-open, one request at a time, for
    as long as the consumer answered 4xx). In a closed breaker a 4xx changes nothing."""
    gate = make_gate(redis_client, prefix)
    await open_and_wait(gate, redis_client)
    probe = await take_probe(gate)
    closed = transitions(HALF_OPEN, CLOSED)

    await gate.report(URL, [(probe, ANSWERED)])

    assert await read_breaker_state(redis_client, URL, prefix) == BreakerState()
    assert transitions(HALF_OPEN, CLOSED) - closed == 1
    assert await gate.admit(URL, [1, 2]) == [ALLOW, ALLOW]
    await fail(gate, 2)
    await gate.report(URL, [(ALLOW, ANSWERED)])
    assert await read_breaker_state(redis_client, URL, prefix) == BreakerState(CLOSED, 2)


async def test_a_probe_without_a_verdict_releases_its_lease(
    redis_client: Redis, prefix: str
) -> None:
    gate = make_gate(redis_client, prefix)
    await open_and_wait(gate, redis_client)
    probe = await take_probe(gate)

    await gate.report(URL, [(probe, None)])

    assert await redis_client.exists(probe_key(URL, prefix)) == 0
    state = await read_breaker_state(redis_client, URL, prefix)
    assert (state.state, state.probe_token) == (HALF_OPEN, "")
    next_probe = await take_probe(gate)
    assert next_probe.probe_token != probe.probe_token


async def test_failures_while_open_do_not_extend_reset_at(redis_client: Redis, prefix: str) -> None:
    gate = make_gate(redis_client, prefix, breaker_reset_ms=60_000)
    in_flight = await gate.admit(URL, [1, 1, 1, 1, 1])
    await fail(gate, 3)
    state = await read_breaker_state(redis_client, URL, prefix)

    # Attempts admitted before the circuit opened finish while it is open.
    await gate.report(URL, [(a, False) for a in in_flight])
    await gate.report(URL, [(in_flight[0], True)])

    assert await read_breaker_state(redis_client, URL, prefix) == state


async def test_a_retry_probe_is_subject_to_the_rate_limit(redis_client: Redis, prefix: str) -> None:
    gate = make_gate(redis_client, prefix, retry_rps=1, breaker_threshold=1, window_ms=60_000)
    await open_and_wait(gate, redis_client)  # its one attempt fills the window

    [limited] = await gate.admit(URL, [2])
    assert limited == Admission(False, delay_ms=60_000, reason="rate_limited")
    assert await redis_client.exists(probe_key(URL, prefix)) == 0
    # A first attempt is never rate limited: it probes.
    await take_probe(gate)


async def test_state_encoding_and_keys(redis_client: Redis, prefix: str) -> None:
    gate = make_gate(redis_client, prefix, breaker_reset_ms=60_000)
    digest = url_digest(URL)
    assert breaker_key(URL, prefix) == f"{prefix}webhook_cb:{{{digest}}}"
    assert probe_key(URL, prefix) == f"{prefix}webhook_cb_probe:{{{digest}}}"

    await fail(gate, 3)
    raw = await redis_client.hgetall(breaker_key(URL, prefix))
    assert set(raw) == {b"state", b"failures", b"reset_at", b"probe"}
    assert raw[b"state"] == b"open"
    assert raw[b"failures"] == b"3"
    assert (
        int(raw[b"reset_at"]) == (await read_breaker_state(redis_client, URL, prefix)).reset_at_ms
    )
    assert raw[b"probe"] == b""
    # An abandoned consumer's state is forgotten eventually, never before its reset.
    assert 60_000 < await redis_client.pttl(breaker_key(URL, prefix)) <= 60_000 + STATE_IDLE_TTL_MS


async def test_consumers_have_separate_breakers(redis_client: Redis, prefix: str) -> None:
    gate = make_gate(redis_client, prefix, breaker_reset_ms=60_000)
    await fail(gate, 3)
    for other in (URL + "/", f"https://evil.example/{url_digest(URL)}"):
        assert await gate.admit(other, [1, 2]) == [ALLOW, ALLOW]
    assert [a.reason for a in await gate.admit(URL, [1])] == ["circuit_open"]


async def test_threshold_zero_disables_the_breaker(redis_client: Redis, prefix: str) -> None:
    gate = make_gate(redis_client, prefix, breaker_threshold=0)
    await gate.report(URL, [(ALLOW, False)] * 50)
    assert await redis_client.exists(breaker_key(URL, prefix)) == 0
    assert await gate.admit(URL, [1, 2]) == [ALLOW, ALLOW]

    # Even a stored open state (say, from an earlier configuration) is ignored.
    far = await server_ms(redis_client) + 3_600_000
    await redis_client.hset(
        breaker_key(URL, prefix),
        mapping={"state": "open", "failures": 9, "reset_at": far, "probe": ""},
    )
    assert await gate.admit(URL, [1, 2]) == [ALLOW, ALLOW]
    await gate.report(URL, [(ALLOW, True)])
    assert (await read_breaker_state(redis_client, URL, prefix)).reset_at_ms == far


async def test_a_stale_probe_lease_does_not_block_the_next_half_open_period(
    redis_client: Redis, prefix: str
) -> None:
    gate = make_gate(redis_client, prefix, breaker_reset_ms=300)
    await fail(gate, 3)
    # A lease left behind (say the state hash was lost while a probe was out).
    await redis_client.set(probe_key(URL, prefix), "stale-owner", px=60_000)
    reset_at = (await read_breaker_state(redis_client, URL, prefix)).reset_at_ms
    await wait_until_server_ms(redis_client, reset_at)

    probe = await take_probe(gate)
    assert await redis_client.get(probe_key(URL, prefix)) == probe.probe_token.encode()
