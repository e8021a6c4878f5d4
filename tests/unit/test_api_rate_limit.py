"""The API's token bucket on a clock of the test's own, and WEBHOOK_API_RATE_LIMIT as the
settings read it (docs/api.md, "Request rate limit")."""

from __future__ import annotations

import pytest

from fluxora_webhooks.api import ratelimit
from fluxora_webhooks.api.dashboard import render
from fluxora_webhooks.errors import ConfigError
from fluxora_webhooks.settings import API_RATE_LIMIT, Settings


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_then_the_refill_rate() -> None:
    clock = Clock()
    limiter = ratelimit.Limiter(10, 10_000, clock=clock)  # 10 at once, one a second
    answers = [limiter.take(b"t1") for _ in range(11)]
    assert [a.allowed for a in answers] == [True] * 10 + [False]
    assert [a.remaining for a in answers[:3]] == [9, 8, 7]
    assert answers[-1].retry_after_s == 1 and answers[-1].reset_s == 10
    clock.now += 0.5
    assert not limiter.take(b"t1").allowed  # half a token
    clock.now += 0.5
    assert limiter.take(b"t1").allowed
    assert not limiter.take(b"t1").allowed
    clock.now += 3600
    answer = limiter.take(b"t1")
    assert answer.allowed and answer.remaining == 9  # full again, never more


def test_keys_are_independent_and_a_slow_rate_says_when_to_come_back() -> None:
    clock = Clock()
    limiter = ratelimit.Limiter(2, 60_000, clock=clock)  # 2 a minute
    assert limiter.take(b"a").allowed and limiter.take(b"a").allowed
    refused = limiter.take(b"a")
    assert not refused.allowed and refused.retry_after_s == 30 and refused.reset_s == 60
    assert limiter.take(b"b").allowed


def test_a_moved_request_is_refunded() -> None:
    limiter = ratelimit.Limiter(2, 60_000, clock=Clock())
    limiter.take(b"address")
    limiter.refund(b"address")
    assert limiter.take(b"address").remaining == 1


def test_idle_buckets_are_dropped_and_their_number_is_bounded() -> None:
    clock = Clock()
    limiter = ratelimit.Limiter(5, 1000, max_buckets=100, clock=clock)
    for n in range(1000):
        limiter.take(n.to_bytes(4, "big"))
    assert len(limiter) == 100  # the least recently used went first
    assert not limiter.known((0).to_bytes(4, "big"))
    clock.now += 1.0  # all full again: no different from none
    for n in range(20):
        limiter.take(b"x" + n.to_bytes(4, "big"))
    assert len(limiter) < 100


def test_a_credential_that_authenticated_keeps_counting_on_its_own_once_its_bucket_refilled() -> (
    None
):
    """Its bucket, full again, is dropped; it still counts against a bucket of its own (a
    client flooding its address does not hold back its next first request). Bounded too."""
    clock = Clock()
    limiter = ratelimit.Limiter(5, 1000, max_buckets=3, clock=clock)
    limiter.take(b"token")
    limiter.prove(b"token", "token 'ops'")
    clock.now += 10.0
    for n in range(3):  # the sweep drops the full bucket
        limiter.take(b"a" + bytes([n]))
    assert limiter.known(b"token") and limiter.label(b"token") == "token 'ops'"
    for n in range(3):
        limiter.prove(b"other" + bytes([n]), "another")
    assert not limiter.known(b"token")  # the least recently seen of more than 3


def test_credentials_are_kept_hashed() -> None:
    token = b"fxa_" + b"s" * 43
    scope = {"path": "/api/v1/endpoints", "headers": [(b"authorization", b"Bearer " + token)]}
    found = ratelimit.credential_key(scope)
    assert found is not None and token not in found[0] and found[1] == "token"
    page = {"path": "/", "headers": [(b"cookie", f"{render.SESSION_COOKIE}=abc".encode())]}
    session = ratelimit.credential_key(page)
    assert session is not None and session[1] == "session" and b"abc" not in session[0]
    assert ratelimit.credential_key({"path": "/api/v1/stats", "headers": []}) is None


def test_ipv6_clients_are_counted_by_their_64() -> None:
    one = ratelimit.address_key({"client": ("2001:db8::1", 1)})
    other = ratelimit.address_key({"client": ("2001:db8::ffff:1", 2)})
    assert one == other
    assert ratelimit.address_key({"client": ("192.0.2.1", 1)})[1] == "client 192.0.2.1"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, API_RATE_LIMIT),
        ("20/s", (20, 1000)),
        ("100/10s", (100, 10_000)),
        (" 5 / 2m ", (5, 120_000)),
        ("50/500ms", (50, 500)),
        ("0", None),
        ("off", None),
    ],
)
def test_the_variable(value: str | None, expected: tuple[int, int] | None) -> None:
    env = {} if value is None else {"WEBHOOK_API_RATE_LIMIT": value}
    assert Settings.from_env(env).api_rate_limit == expected


@pytest.mark.parametrize(
    "value", ["", "fast", "20", "20/", "/s", "0/s", "-1/s", "20/0s", "20/2d", "2/x", "1e3/s"]
)
def test_a_bad_value_names_the_variable(value: str) -> None:
    with pytest.raises(ConfigError, match="WEBHOOK_API_RATE_LIMIT"):
        Settings.from_env({"WEBHOOK_API_RATE_LIMIT": value})
