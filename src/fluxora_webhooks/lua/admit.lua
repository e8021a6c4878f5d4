-- KEYS: rate limit set, breaker hash, probe lease (one hash slot).
-- ARGV: window_ms, limit, threshold (0: no breaker), reset_ms, probe_ttl_ms, state_ttl_ms,
--       token, then one flag per attempt: '1' retry, '0' first attempt.
-- Returns {now, from_state, to_state, code1, delay1, code2, delay2, ...} (admit_url.lua).
local now = now_ms()
local out = {now}
admit_url(out, KEYS[1], KEYS[2], KEYS[3], now, tonumber(ARGV[1]), tonumber(ARGV[2]),
          tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]),
          ARGV[7], 8, #ARGV)
return out
