-- KEYS: breaker hash, probe lease. ARGV: threshold, reset_ms, state_ttl_ms, then one
-- (outcome, probe token) pair per result: outcome '1' delivered, '0' retryable failure,
-- 'a' a permanent failure the consumer answered, '-' no word of the consumer. Returns the transitions made: {from1, to1, from2, to2, ...}.
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
