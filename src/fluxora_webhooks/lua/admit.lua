-- The gate's admission for one or more consumer URLs in one call: for each URL, the
-- breaker check, then the retry limit. Every key of a call must live on one Redis node:
-- one URL's keys share a Cluster hash slot (their braces); several URLs' keys do so only on
-- a single node, so on a Cluster the gate calls this once per URL.
-- KEYS: per URL, its rate limit set, breaker hash and probe lease.
-- ARGV: window_ms, threshold (0: no breaker), reset_ms, probe_ttl_ms, state_ttl_ms, token,
--       then per URL: its limit, its number of attempts n, and n flags ('1' retry, '0' first
--       attempt).
-- Returns {now, then per URL: from_state, to_state, code1, delay1, code2, delay2, ...}; the
-- codes are the AdmitCode constants (ALLOWED, PROBE, RATE_LIMITED, CIRCUIT_OPEN,
-- ALLOWED_CLEAN: allowed while the breaker is closed with no failure) that the loader
-- defines from gate.AdmitCode; from/to name the breaker transition this call made
-- for that URL ('' when none).

local function admit_url(out, rl_key, cb_key, pr_key, now, window, limit, threshold,
                         reset_ms, probe_ttl, state_ttl, token, first, last)
  local cb = nil
  local from, to = '', ''
  if threshold > 0 then
    cb = cb_load(cb_key)
    local before = cb.state
    cb_tick(cb, now, pr_key)
    if cb.state ~= before then from, to = before, cb.state end
  end
  local count = rl_count(rl_key, now, window)
  local recorded = 0
  local probing = false
  out[#out + 1] = from
  out[#out + 1] = to
  for i = first, last do
    local state = cb and cb.state or 'closed'
    local code, delay = ALLOWED, 0
    if state == 'open' then
      code, delay = CIRCUIT_OPEN, math.max(1, cb.reset_at - now)
    elseif state == 'half-open' and (probing or not cb_probe_free(pr_key, token)) then
      code, delay = CIRCUIT_OPEN, cb_probe_wait(pr_key, probe_ttl, reset_ms)
    elseif ARGV[i] == '1' and count >= limit then
      code, delay = RATE_LIMITED, window
    elseif state == 'half-open' and not cb_take_probe(cb, pr_key, token, probe_ttl) then
      code, delay = CIRCUIT_OPEN, cb_probe_wait(pr_key, probe_ttl, reset_ms)
    else
      if state == 'half-open' then
        code = PROBE
        probing = true
      elseif cb and state == 'closed' and cb.failures == 0 then
        code = ALLOWED_CLEAN
      end
      rl_record(rl_key, now, token, i)
      count = count + 1
      recorded = recorded + 1
    end
    out[#out + 1] = code
    out[#out + 1] = delay
  end
  if recorded > 0 then rl_expire(rl_key, window) end
  if cb then cb_save(cb_key, cb, state_ttl) end
end

local now = now_ms()
local out = {now}
local a = 7
for u = 0, #KEYS / 3 - 1 do
  local limit, n = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
  admit_url(out, KEYS[3 * u + 1], KEYS[3 * u + 2], KEYS[3 * u + 3], now, tonumber(ARGV[1]),
            limit, tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]),
            tonumber(ARGV[5]), ARGV[6], a + 2, a + 1 + n)
  a = a + 2 + n
end
return out
