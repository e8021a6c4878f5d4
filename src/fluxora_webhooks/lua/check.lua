-- The start-up check: every command the gate's scripts run (and HGETALL, which reads a
-- breaker), on keys of this check's own under the gate's key names (one hash tag), each
-- through redis.pcall so that one refusal does not hide the next. An ACL that lacks a
-- command, a read-only replica: each refused command is named.
-- KEYS: a rate-limit set, a breaker hash, a probe lease.
-- ARGV: '1' when the circuit breaker is on (its commands are checked too), else '0'.
-- The keys expire within 10 s; the breaker's are deleted (DEL is the breaker's command).
-- Returns {command1, error1, command2, error2, ...}: the commands refused ({} when none).
local refused = {}
local function try(name, ...)
  local reply = redis.pcall(...)
  if type(reply) == 'table' and reply.err then
    refused[#refused + 1] = name
    refused[#refused + 1] = reply.err
  end
end

try('TIME', 'TIME')
try('ZREMRANGEBYSCORE', 'ZREMRANGEBYSCORE', KEYS[1], '-inf', 0)
try('ZADD', 'ZADD', KEYS[1], 0, 'check')
try('ZCARD', 'ZCARD', KEYS[1])
try('PEXPIRE', 'PEXPIRE', KEYS[1], 10000)
if ARGV[1] == '1' then
  try('HMGET', 'HMGET', KEYS[2], 'state')
  try('HSET', 'HSET', KEYS[2], 'state', 'closed')
  try('PEXPIRE', 'PEXPIRE', KEYS[2], 10000)
  try('HGETALL', 'HGETALL', KEYS[2])
  try('GET', 'GET', KEYS[3])
  try('SET', 'SET', KEYS[3], 'check', 'NX', 'PX', 10000)
  try('PTTL', 'PTTL', KEYS[3])
  try('DEL', 'DEL', KEYS[2], KEYS[3])
end
return refused
