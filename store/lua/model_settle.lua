-- The end of an admitted model call (store/domain/limiter.py, EndpointLimiter.settle).
--
-- KEYS[1]  the endpoint's state hash ({ns}:{m:<id>}:limit)
-- KEYS[2]  the endpoint's calls in flight, a zset
-- ARGV[1]  ticket
-- ARGV[2]  ms per token (0: no token limit)
-- ARGV[3]  tokens the call really used minus its estimate (may be negative; 0: unknown)
--
-- Frees the call's place in flight and corrects the token schedule by what the reply's usage
-- said. Returns 1.
redis.call('ZREM', KEYS[2], ARGV[1])
local tok_ms, delta = tonumber(ARGV[2]), tonumber(ARGV[3])
if tok_ms > 0 and delta ~= 0 then
  local tat = tonumber(redis.call('HGET', KEYS[1], 'tat_tok') or '0')
  if tat > 0 then redis.call('HSET', KEYS[1], 'tat_tok', tat + tok_ms * delta) end
end
return 1
