-- Several URLs in one call, on a single Redis node (each URL's keys share a Cluster hash
-- slot, but different URLs do not: a cluster gets one admit.lua call per URL instead).
-- KEYS: per URL, its rate limit set, breaker hash and probe lease.
-- ARGV: window_ms, threshold (0: no breaker), reset_ms, probe_ttl_ms, state_ttl_ms, token,
--       then per URL: its limit, its number of attempts n, and n flags ('1' retry).
-- Returns {now, then per URL: from_state, to_state, code1, delay1, ...} (admit_url.lua).
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
