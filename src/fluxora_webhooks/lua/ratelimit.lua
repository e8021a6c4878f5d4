-- The sliding-window retry limit (see redis_gate.py for the keys).
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
