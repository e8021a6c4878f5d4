-- KEYS: rate limit set, breaker hash, probe lease (one hash slot).
-- ARGV: window_ms, limit, threshold (0: no breaker), reset_ms, probe_ttl_ms, state_ttl_ms,
--       token, then one flag per attempt: '1' retry, '0' first attempt.
-- Returns {now, from_state, to_state, code1, delay1, code2, delay2, ...}; the codes are
-- the AdmitCode constants (ALLOWED, PROBE, RATE_LIMITED, CIRCUIT_OPEN) that the loader
-- defines from gate.AdmitCode; from/to name the breaker transition this call made ('' when
-- none).
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
  local code, delay = ALLOWED, 0
  if state == 'open' then
    code, delay = CIRCUIT_OPEN, math.max(1, cb.reset_at - now)
  elseif state == 'half-open' and (probing or not cb_probe_free(KEYS[3], token)) then
    code, delay = CIRCUIT_OPEN, cb_probe_wait(KEYS[3], probe_ttl, reset_ms)
  elseif ARGV[i] == '1' and count >= limit then
    code, delay = RATE_LIMITED, window
  elseif state == 'half-open' and not cb_take_probe(cb, KEYS[3], token, probe_ttl) then
    code, delay = CIRCUIT_OPEN, cb_probe_wait(KEYS[3], probe_ttl, reset_ms)
  else
    if state == 'half-open' then
      code = PROBE
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
