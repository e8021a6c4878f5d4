"""The shared circuit breaker: one state per consumer URL in Redis, changed only by Lua.

State is a hash at ``{prefix}webhook_cb:{<sha256 hex of the URL>}``:

=========  ===============================================================================
field      meaning
=========  ===============================================================================
state      ``closed``, ``open`` or ``half-open``
failures   consecutive retryable failures counted while closed
reset_at   Redis server time (ms) when an open circuit may be probed
probe      token of the current half-open probe's owner (``""`` when none)
=========  ===============================================================================

A missing hash means closed with no failures: closing deletes it, so healthy consumers cost
nothing. A stored hash expires ``reset_ms`` + one day after its last change, which only
forgets consumers that stopped sending.

The probe lease is ``{prefix}webhook_cb_probe:{<digest>}``, taken with ``SET NX PX probe_ttl``
and holding the owner's token: exactly one attempt across all instances probes a half-open
circuit, and a probe whose dispatcher crashed expires so a later attempt can probe again.
Only the latest owner's report (token equal to the ``probe`` field) closes or re-opens a
half-open circuit; while open, reports change nothing, so stragglers cannot extend
``reset_at``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from .ratelimit import hash_tagged

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half-open"

BREAKER_KEY = "webhook_cb:"
PROBE_KEY = "webhook_cb_probe:"

# How long a breaker hash outlives its last change, beyond reset_ms.
STATE_IDLE_TTL_MS = 86_400_000


def breaker_key(url: str, prefix: str = "") -> str:
    """The hash holding the breaker state of ``url``."""
    return hash_tagged(prefix, BREAKER_KEY, url)


def probe_key(url: str, prefix: str = "") -> str:
    """The half-open probe lease of ``url``."""
    return hash_tagged(prefix, PROBE_KEY, url)


@dataclass(frozen=True, slots=True)
class BreakerState:
    """A snapshot of one consumer's breaker, for operators and tests."""

    state: str = CLOSED
    failures: int = 0
    reset_at_ms: int = 0
    probe_token: str = ""


async def read_breaker_state(redis: Redis, url: str, prefix: str = "") -> BreakerState:
    """Read the stored state of ``url``'s breaker (closed when nothing is stored)."""
    raw: dict[Any, Any] = await redis.hgetall(breaker_key(url, prefix))
    fields = {_text(k): _text(v) for k, v in raw.items()}
    state = fields.get("state", CLOSED)
    return BreakerState(
        state=state if state in (OPEN, HALF_OPEN) else CLOSED,
        failures=int(fields.get("failures") or 0),
        reset_at_ms=int(fields.get("reset_at") or 0),
        probe_token=fields.get("probe", ""),
    )


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# Lua 5.1 functions shared by the admit and report scripts. A breaker table carries
# `dirty` so a script writes the hash only when something changed.
BREAKER_LUA = """
local function cb_load(key)
  local f = redis.call('HMGET', key, 'state', 'failures', 'reset_at', 'probe')
  local state = f[1]
  if state ~= 'open' and state ~= 'half-open' then state = 'closed' end
  return {state = state, failures = tonumber(f[2]) or 0, reset_at = tonumber(f[3]) or 0,
          probe = f[4] or '', dirty = false}
end

local function cb_save(key, cb, ttl)
  if not cb.dirty then return end
  if cb.state == 'closed' and cb.failures == 0 then
    redis.call('DEL', key)
  else
    redis.call('HSET', key, 'state', cb.state, 'failures', cb.failures,
               'reset_at', cb.reset_at, 'probe', cb.probe)
    redis.call('PEXPIRE', key, ttl)
  end
end

-- An open circuit whose reset time has come turns half-open, with its probe not taken
-- (a lease left over from an earlier half-open period is stale: drop it).
local function cb_tick(cb, now, probe_key)
  if cb.state == 'open' and now >= cb.reset_at then
    redis.call('DEL', probe_key)
    cb.state = 'half-open'
    cb.probe = ''
    cb.dirty = true
  end
end

-- Half-open: is the probe lease free, or already held by this very call (re-executed)?
local function cb_probe_free(probe_key, token)
  local owner = redis.call('GET', probe_key)
  return (not owner) or owner == token
end

local function cb_take_probe(cb, probe_key, token, ttl)
  if redis.call('SET', probe_key, token, 'NX', 'PX', ttl)
      or redis.call('GET', probe_key) == token then
    cb.probe = token
    cb.dirty = true
    return true
  end
  return false
end

-- How long to defer an attempt while another attempt probes: until the lease ends (the
-- probe has answered or crashed by then), never longer than a reset period.
local function cb_probe_wait(probe_key, ttl, reset_ms)
  local left = redis.call('PTTL', probe_key)
  if left < 1 then left = ttl end
  return math.max(1, math.min(left, reset_ms))
end

local function cb_release_probe(cb, probe_key, token)
  if redis.call('GET', probe_key) == token then redis.call('DEL', probe_key) end
  cb.probe = ''
  cb.dirty = true
end

-- One reported result: outcome '1' delivered, '0' retryable failure, '-' neither.
local function cb_record(cb, outcome, token, now, threshold, reset_ms, probe_key)
  if cb.state == 'closed' then
    if outcome == '1' and cb.failures > 0 then
      cb.failures = 0
      cb.dirty = true
    elseif outcome == '0' then
      cb.failures = cb.failures + 1
      cb.dirty = true
      if cb.failures >= threshold then
        cb.state = 'open'
        cb.reset_at = now + reset_ms
      end
    end
  elseif cb.state == 'half-open' and token ~= '' and token == cb.probe then
    cb_release_probe(cb, probe_key, token)
    if outcome == '1' then
      cb.state = 'closed'
      cb.failures = 0
    elseif outcome == '0' then
      cb.state = 'open'
      cb.reset_at = now + reset_ms
    end
  end
end
"""
