"""The delivery gate on Redis: the retry rate limit and the circuit breaker, shared by all
dispatcher instances, at one round trip per batch.

``admit`` runs one Lua script (breaker check, then rate limit, for the whole batch) and
``report`` runs another (breaker bookkeeping); both read the Redis server's clock, so the
instances agree on time. See :mod:`.ratelimit` and :mod:`.breaker` for the keys.

Redis is a protection, not a dependency: when it is down, slow or answers an error, the
gate fails open (``admit`` allows everything, ``report`` does nothing), counts
``fluxora_webhook_redis_fail_open_total{component}`` and logs one warning per outage. After
a failure it leaves Redis alone for a short back-off, so an outage costs one timeout per
back-off period rather than one per batch; the first call after the back-off tries again,
and the gate protects again as soon as Redis answers.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError

from . import metrics
from .breaker import BREAKER_LUA, STATE_IDLE_TTL_MS, breaker_key, probe_key
from .gate import ALLOW, Admission
from .ratelimit import RATE_LIMIT_LUA, rate_limit_key
from .redis_connect import client_for, detect_cluster

log = logging.getLogger(__name__)

T = TypeVar("T")

# Client defaults of connect_gate: a gate check must never hold a batch for long.
CONNECT_TIMEOUT_S = 0.25
SOCKET_TIMEOUT_S = 0.5
HEALTH_CHECK_INTERVAL_S = 10

# Admit codes returned by the script, one per attempt.
_ALLOWED, _PROBE, _RATE_LIMITED, _CIRCUIT_OPEN = 0, 1, 2, 3

_NOW_LUA = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

ADMIT_LUA = (
    _NOW_LUA
    + BREAKER_LUA
    + RATE_LIMIT_LUA
    + """
-- KEYS: rate limit set, breaker hash, probe lease (one hash slot).
-- ARGV: window_ms, limit, threshold (0: no breaker), reset_ms, probe_ttl_ms, state_ttl_ms,
--       token, then one flag per attempt: '1' retry, '0' first attempt.
-- Returns {now, from_state, to_state, code1, delay1, code2, delay2, ...}; code 0 allowed,
-- 1 allowed as the probe, 2 rate limited, 3 circuit open; from/to name the breaker
-- transition this call made ('' when none).
local window = tonumber(ARGV[1])
local limit = tonumber(ARGV[2])
local threshold = tonumber(ARGV[3])
local reset_ms = tonumber(ARGV[4])
local probe_ttl = tonumber(ARGV[5])
local token = ARGV[7]
local now = now_ms()
local cb = nil
local from, to = '', ''
if threshold > 0 then
  cb = cb_load(KEYS[2])
  local before = cb.state
  cb_tick(cb, now, KEYS[3])
  if cb.state ~= before then from, to = before, cb.state end
end
local count = rl_count(KEYS[1], now, window)
local recorded = 0
local probing = false
local out = {now, from, to}
for i = 8, #ARGV do
  local state = cb and cb.state or 'closed'
  local code, delay = 0, 0
  if state == 'open' then
    code, delay = 3, math.max(1, cb.reset_at - now)
  elseif state == 'half-open' and (probing or not cb_probe_free(KEYS[3], token)) then
    code, delay = 3, cb_probe_wait(KEYS[3], probe_ttl, reset_ms)
  elseif ARGV[i] == '1' and count >= limit then
    code, delay = 2, window
  elseif state == 'half-open' and not cb_take_probe(cb, KEYS[3], token, probe_ttl) then
    code, delay = 3, cb_probe_wait(KEYS[3], probe_ttl, reset_ms)
  else
    if state == 'half-open' then
      code = 1
      probing = true
    end
    rl_record(KEYS[1], now, token, i)
    count = count + 1
    recorded = recorded + 1
  end
  out[#out + 1] = code
  out[#out + 1] = delay
end
if recorded > 0 then rl_expire(KEYS[1], window) end
if cb then cb_save(KEYS[2], cb, tonumber(ARGV[6])) end
return out
"""
)

REPORT_LUA = (
    _NOW_LUA
    + BREAKER_LUA
    + """
-- KEYS: breaker hash, probe lease. ARGV: threshold, reset_ms, state_ttl_ms, then one
-- (outcome, probe token) pair per result: outcome '1' delivered, '0' retryable failure,
-- '-' neither. Returns the transitions made: {from1, to1, from2, to2, ...}.
local threshold = tonumber(ARGV[1])
local reset_ms = tonumber(ARGV[2])
local now = now_ms()
local cb = cb_load(KEYS[1])
local out = {}
for i = 4, #ARGV, 2 do
  local before = cb.state
  cb_record(cb, ARGV[i], ARGV[i + 1], now, threshold, reset_ms, KEYS[2])
  if cb.state ~= before then
    out[#out + 1] = before
    out[#out + 1] = cb.state
  end
end
cb_save(KEYS[1], cb, tonumber(ARGV[3]))
return out
"""
)


class RedisGate:
    """A :class:`~fluxora_webhooks.gate.DeliveryGate` shared through Redis.

    ``retry_rps`` retries are allowed per ``window_ms`` per consumer URL (first attempts
    are counted, never refused). ``breaker_threshold`` consecutive retryable failures open
    the circuit for ``breaker_reset_ms``; 0 disables the breaker. ``probe_ttl_ms`` bounds
    how long a half-open probe may hold its lease (longer than one HTTP attempt).
    ``prefix`` goes before every key. ``timeout_ms`` bounds each Redis call,
    ``failure_backoff_ms`` is how long the gate fails open without trying Redis after a
    failure. Each call that fails open counts once in ``REDIS_FAIL_OPEN``, labelled
    ``gate`` (admit, breaker on), ``ratelimit`` (admit, breaker off) or ``breaker``
    (report).

    The gate does not close a client it was given; :func:`connect_gate` makes a gate that
    owns (and closes) its client.
    """

    def __init__(
        self,
        redis: Redis,
        *,
        retry_rps: int,
        breaker_threshold: int,
        breaker_reset_ms: int,
        probe_ttl_ms: int,
        prefix: str = "",
        window_ms: int = 1000,
        timeout_ms: int = 750,
        failure_backoff_ms: int = 1000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for name, value, low in (
            ("retry_rps", retry_rps, 1),
            ("breaker_threshold", breaker_threshold, 0),
            ("breaker_reset_ms", breaker_reset_ms, 1),
            ("probe_ttl_ms", probe_ttl_ms, 1),
            ("window_ms", window_ms, 1),
            ("timeout_ms", timeout_ms, 1),
            ("failure_backoff_ms", failure_backoff_ms, 0),
        ):
            if value < low:
                raise ValueError(f"{name} must be at least {low}, got {value}")
        if "{" in prefix or "}" in prefix:
            # A brace in the prefix would change the hash tag and split a URL's keys
            # across Cluster slots, breaking the scripts.
            raise ValueError("the Redis key prefix must not contain '{' or '}'")
        self._redis = redis
        self._owns_client = False
        self.retry_rps = retry_rps
        self.breaker_threshold = breaker_threshold
        self.breaker_reset_ms = breaker_reset_ms
        self.probe_ttl_ms = probe_ttl_ms
        self.prefix = prefix
        self.window_ms = window_ms
        self._timeout_s = timeout_ms / 1000
        self._state_ttl_ms = breaker_reset_ms + STATE_IDLE_TTL_MS
        self._admit_script = redis.register_script(ADMIT_LUA)
        self._report_script = redis.register_script(REPORT_LUA)
        password = redis.connection_pool.connection_kwargs.get("password")
        self._outage = _Outage(failure_backoff_ms / 1000, clock, str(password or ""))

    @property
    def available(self) -> bool:
        """False from a failed Redis call until the next successful one."""
        return not self._outage.down

    async def admit(self, url: str, attempts: Sequence[int]) -> list[Admission]:
        if not attempts:
            return []
        token = secrets.token_hex(8)
        keys = [
            rate_limit_key(url, self.prefix),
            breaker_key(url, self.prefix),
            probe_key(url, self.prefix),
        ]
        args: list[str | int] = [
            self.window_ms,
            self.retry_rps,
            self.breaker_threshold,
            self.breaker_reset_ms,
            self.probe_ttl_ms,
            self._state_ttl_ms,
            token,
        ]
        args.extend("1" if attempt > 1 else "0" for attempt in attempts)
        component = "gate" if self.breaker_threshold > 0 else "ratelimit"
        decided = await self._call(
            component,
            self._admit_script,
            keys,
            args,
            lambda reply: _decode_admit(reply, token, len(attempts)),
        )
        if decided is None:
            return [ALLOW] * len(attempts)
        admissions, transition = decided
        if transition is not None:
            _count_transition(*transition)
        rate_limited = sum(1 for a in admissions if a.reason == "rate_limited")
        circuit_open = sum(1 for a in admissions if a.reason == "circuit_open")
        if rate_limited:
            metrics.RATE_LIMIT_DEFERRALS.inc(rate_limited)
        if circuit_open:
            metrics.CIRCUIT_DEFERRALS.inc(circuit_open)
        return admissions

    async def report(self, url: str, results: Sequence[tuple[Admission, bool | None]]) -> None:
        if self.breaker_threshold <= 0:
            return
        args: list[str | int] = [self.breaker_threshold, self.breaker_reset_ms, self._state_ttl_ms]
        for admission, outcome in results:
            if not admission.allowed or (outcome is None and not admission.probe):
                continue  # nothing to record (a probe's None still releases its lease)
            args.append("-" if outcome is None else "1" if outcome else "0")
            args.append(admission.probe_token if admission.probe else "")
        if len(args) == 3:
            return
        keys = [breaker_key(url, self.prefix), probe_key(url, self.prefix)]
        transitions = await self._call(
            "breaker", self._report_script, keys, args, _decode_transitions
        )
        for from_state, to_state in transitions or ():
            _count_transition(from_state, to_state)

    async def ping(self) -> bool:
        """Whether Redis answers now (bounded, never raises); updates the outage state."""
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._redis.ping()
        except Exception as exc:
            self._outage.failed(exc)
            return False
        self._outage.recovered()
        return True

    async def close(self) -> None:
        if self._owns_client:
            await self._redis.aclose()

    async def _call(
        self,
        component: str,
        script: AsyncScript,
        keys: list[str],
        args: list[str | int],
        decode: Callable[[Any], T],
    ) -> T | None:
        """Run one script (one EVALSHA); ``None`` (fail open, counted) on any failure."""
        if not self._outage.should_try():
            metrics.REDIS_FAIL_OPEN.labels(component=component).inc()
            return None
        try:
            async with asyncio.timeout(self._timeout_s):
                result = decode(await script(keys=keys, args=args))
        except Exception as exc:  # any failure: deliveries must go on without the gate
            self._outage.failed(exc)
            metrics.REDIS_FAIL_OPEN.labels(component=component).inc()
            return None
        self._outage.recovered()
        return result


async def connect_gate(
    redis_url: str,
    *,
    retry_rps: int,
    breaker_threshold: int,
    breaker_reset_ms: int,
    probe_ttl_ms: int,
    prefix: str = "",
    window_ms: int = 1000,
    timeout_ms: int = 750,
    failure_backoff_ms: int = 1000,
) -> RedisGate:
    """A :class:`RedisGate` with its own client (closed by :meth:`RedisGate.close`).

    The client has short connect and read timeouts, health checks idle connections, and
    retries a command once, at once, only when the connection broke (a stale pooled
    connection after a Redis restart). A Redis that is down at start is not an error:
    the gate starts failing open and picks Redis up when it comes. A URL that names a node
    of a Redis Cluster gets redis-py's cluster client (:mod:`.redis_connect`).
    """
    client = client_for(
        redis_url,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        socket_timeout=SOCKET_TIMEOUT_S,
        health_check_interval=HEALTH_CHECK_INTERVAL_S,
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
    )
    await detect_cluster(client, timeout_ms / 1000)  # a Redis Cluster node: see redis_connect
    gate = RedisGate(
        client,
        retry_rps=retry_rps,
        breaker_threshold=breaker_threshold,
        breaker_reset_ms=breaker_reset_ms,
        probe_ttl_ms=probe_ttl_ms,
        prefix=prefix,
        window_ms=window_ms,
        timeout_ms=timeout_ms,
        failure_backoff_ms=failure_backoff_ms,
    )
    gate._owns_client = True
    await gate.ping()
    return gate


class _Outage:
    """Fail-open bookkeeping: one warning per outage, and a back-off between tries."""

    def __init__(self, backoff_s: float, clock: Callable[[], float], secret: str) -> None:
        self._backoff_s = backoff_s
        self._clock = clock
        self._secret = secret
        self.down = False
        self._retry_at = 0.0

    def should_try(self) -> bool:
        if not self.down:
            return True
        now = self._clock()
        if now < self._retry_at:
            return False
        # This caller tries; concurrent callers keep failing open until it knows.
        self._retry_at = now + self._backoff_s
        return True

    def failed(self, exc: BaseException) -> None:
        self._retry_at = self._clock() + self._backoff_s
        if not self.down:
            self.down = True
            log.warning(
                "Redis unavailable (%s); the delivery gate fails open (no rate limit, no "
                "circuit breaker) until Redis answers again",
                self._describe(exc),
            )

    def recovered(self) -> None:
        if self.down:
            self.down = False
            log.info("Redis answers again; the delivery gate protects consumers again")

    def _describe(self, exc: BaseException) -> str:
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return text.replace(self._secret, "***") if self._secret else text


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _decode_admit(
    reply: Any, token: str, count: int
) -> tuple[list[Admission], tuple[str, str] | None]:
    values = list(reply)
    if len(values) != 3 + 2 * count:
        raise ValueError(f"admit script answered {len(values)} values for {count} attempts")
    from_state, to_state = _text(values[1]), _text(values[2])
    admissions: list[Admission] = []
    for i in range(3, len(values), 2):
        code, delay = int(values[i]), int(values[i + 1])
        if code == _ALLOWED:
            admissions.append(ALLOW)
        elif code == _PROBE:
            admissions.append(Admission(True, probe=True, probe_token=token))
        elif code == _RATE_LIMITED:
            admissions.append(Admission(False, delay_ms=delay, reason="rate_limited"))
        elif code == _CIRCUIT_OPEN:
            admissions.append(Admission(False, delay_ms=delay, reason="circuit_open"))
        else:
            raise ValueError(f"admit script answered unknown code {code}")
    return admissions, ((from_state, to_state) if from_state else None)


def _decode_transitions(reply: Any) -> list[tuple[str, str]]:
    values = [_text(v) for v in reply]
    return list(zip(values[::2], values[1::2], strict=True))


def _count_transition(from_state: str, to_state: str) -> None:
    metrics.BREAKER_TRANSITIONS.labels(from_state=from_state, to_state=to_state).inc()
