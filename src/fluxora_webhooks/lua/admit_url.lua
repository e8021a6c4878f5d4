-- One URL's admission, for admit.lua and admit_many.lua: the breaker check, then the
-- retry limit, for the flags ARGV[first..last] ('1' retry, '0' first attempt). Appends
-- from_state, to_state (the breaker transition made, '' when none), then one (code,
-- delay) pair per flag to out; the codes are the AdmitCode constants.
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
