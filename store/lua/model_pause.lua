-- A provider refused a call for its rate limit (store/limiter.py, EndpointLimiter.pause).
--
-- KEYS[1]  the endpoint's state hash ({ns}:{m:<id>}:limit)
-- ARGV[1]  ms the provider asked to wait
--
-- Pauses the endpoint for every host until then (a later pause never shortens an earlier
-- one). Returns the pause's end (server ms).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local until_ms = now + tonumber(ARGV[1])
local current = tonumber(redis.call('HGET', KEYS[1], 'paused_until') or '0')
if until_ms > current then
  redis.call('HSET', KEYS[1], 'paused_until', until_ms)
  redis.call('PEXPIRE', KEYS[1], 3600000)
  return until_ms
end
return current
