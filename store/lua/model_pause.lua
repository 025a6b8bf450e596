-- A provider refused a call for its rate limit (store/limiter.py, EndpointLimiter.pause).
--
-- KEYS[1]  the endpoint's state hash ({ns}:{m:<id>}:limit)
-- ARGV[1]  ms the provider asked to wait
-- ARGV[2]  ms the endpoint's state lives after this (store/limiter.py, STATE_KEEP_MS)
--
-- Pauses the endpoint for every host until then (a later pause never shortens an earlier
-- one), and doubles its spacing: after the pause, calls go one at a time at least gap_ms apart
-- (100 ms after a first refusal, doubled by each refusal that comes after the pause it set is
-- over, up to 10 s; model_admit.lua lets it halve every 30 s), so the calls held back do not
-- all arrive at the same moment and meet the same refusal. Returns the pause's end (server ms).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local until_ms = now + tonumber(ARGV[1])
local current = tonumber(redis.call('HGET', KEYS[1], 'paused_until') or '0')
local gap = tonumber(redis.call('HGET', KEYS[1], 'gap_ms') or '0')
local gap_at = tonumber(redis.call('HGET', KEYS[1], 'gap_at') or '0')
if gap > 0 and now > gap_at then gap = gap * 0.5 ^ ((now - gap_at) / 30000) end
if now >= current then
  -- a refusal after calls resumed: the spacing was not enough. Refusals of calls sent before
  -- a pause began arrive while it lasts and say nothing new: they do not grow it again.
  redis.call('HSET', KEYS[1], 'gap_ms', math.min(math.max(2 * gap, 100), 10000),
    'gap_at', math.max(until_ms, current))
end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
if until_ms > current then
  redis.call('HSET', KEYS[1], 'paused_until', until_ms)
  return until_ms
end
return current
