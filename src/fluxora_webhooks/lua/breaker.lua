-- The circuit breaker's state changes (see redis_gate.py for the hash's fields). A
-- breaker table carries `dirty` so a script writes the hash only when something changed.
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

-- One reported result: outcome '1' delivered, '0' retryable failure, 'a' a permanent
-- failure the consumer answered (a 4xx: it is up), '-' no word of the consumer.
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
    if outcome == '1' or outcome == 'a' then  -- the consumer answered: it is up
      cb.state = 'closed'
      cb.failures = 0
    elseif outcome == '0' then
      cb.state = 'open'
      cb.reset_at = now + reset_ms
    end
  end
end
