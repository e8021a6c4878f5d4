"""The shared retry rate limit: a sliding-window log per consumer URL in Redis.

One sorted set per consumer at ``{prefix}webhook_rl:{<sha256 hex of the URL>}`` holds one
member per outbound attempt, scored by the Redis server's clock in milliseconds, so every
dispatcher instance counts against the same window. A check prunes the members older than
the window, counts the rest and records each attempt it lets through, all inside one Lua
script (:data:`RATE_LIMIT_LUA`, composed into the gate's admit script by
:mod:`.redis_gate`), so concurrent dispatchers cannot overshoot.

First attempts are recorded but never refused; a retry is refused while the window already
holds ``limit`` attempts. The set expires one window after its last member was added.
"""

from __future__ import annotations

import hashlib

RATE_LIMIT_KEY = "webhook_rl:"


def url_digest(url: str) -> str:
    """The full SHA-256 hex digest of the full URL: the only form of a URL in Redis keys."""
    return hashlib.sha256(url.encode("utf-8", "surrogatepass")).hexdigest()


def hash_tagged(prefix: str, name: str, url: str) -> str:
    """``{prefix}{name}{<digest>}``: the braces make a URL's keys share a Cluster slot."""
    return f"{prefix}{name}{{{url_digest(url)}}}"


def rate_limit_key(url: str, prefix: str = "") -> str:
    """The sorted set of the attempts sent to ``url`` within the last window."""
    return hash_tagged(prefix, RATE_LIMIT_KEY, url)


# Lua 5.1 functions for the admit script; `now` is the Redis server's TIME in ms.
RATE_LIMIT_LUA = """
-- Drop the attempts that left the window (now - window, now]; return how many remain.
local function rl_count(key, now, window)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now - window)
  return redis.call('ZCARD', key)
end

-- Record one attempt. Members are unique per call (token) and per attempt (i), so a
-- re-executed call overwrites its own members instead of counting twice.
local function rl_record(key, now, token, i)
  redis.call('ZADD', key, now, token .. ':' .. i)
end

-- Every member is older than the window once a window has passed since the newest one.
local function rl_expire(key, window)
  redis.call('PEXPIRE', key, window)
end
"""
