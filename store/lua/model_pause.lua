-- A provider refused a call for its rate limit (store/domain/limiter.py, EndpointLimiter.pause).
--
-- KEYS[1]  the endpoint's state hash ({ns}:{m:<id>}:limit)
-- ARGV[1]  ms the provider asked to wait (1 when it said nothing)
-- ARGV[2]  ms the endpoint's state lives after this (store/domain/limiter.py, STATE_KEEP_MS)
-- ARGV[3]  ms since the refused call was admitted (sent)
-- ARGV[4]  ms a spacing must have held before its calls are counted into a rate
--          (store/domain/limiter.py, ESTIMATE_MIN_MS)
-- ARGV[5]  ms it may have held at most (longer: the provider's bucket may have refilled past
--          what it holds, and the count says too little; ESTIMATE_MAX_MS)
-- ARGV[6]  ms in which the spacing halves (store/domain/limiter.py, GAP_HALF_LIFE_MS)
--
-- Pauses the endpoint for every host until then (a later pause never shortens an earlier
-- one) and, for an endpoint that declared no rate, sets the spacing of its calls (gap_ms,
-- which model_admit.lua applies; it halves every ARGV[6] ms from the pause's end, so an
-- endpoint that allows more is found again).
--
-- A provider's bucket is empty at each refusal, so the calls it accepted between two
-- refusals are what it refilled in between. A spacing starts at a refusal (regime_at) and
-- counts the calls admitted under it (regime_sent); the next refusal of one of them ends it,
-- and the calls that went, over the time it held, are the provider's rate: the new spacing is
-- that rate's interval with a 10 % margin. A spacing that held too briefly for a count grows
-- by a quarter (the first refusal sets 100 ms, whatever spacing the first calls had). Only a
-- call sent under the current spacing says it was too close: refusals of calls sent before it
-- was set (a burst in flight, a slow provider's answers) change nothing but the pause.
-- Returns the pause's end (server ms).
local state = KEYS[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local until_ms = now + tonumber(ARGV[1])
local sent_at = now - tonumber(ARGV[3])
local shortest, longest = tonumber(ARGV[4]), tonumber(ARGV[5])
local f = redis.call('HMGET', state, 'paused_until', 'gap_ms', 'gap_at', 'regime_at',
  'regime_sent')
local current, gap, gap_at = tonumber(f[1] or '0'), tonumber(f[2] or '0'), tonumber(f[3] or '0')
local regime_at, went = tonumber(f[4] or '0'), tonumber(f[5] or '0') - 1  -- not this one
if gap > 0 and now > gap_at then gap = gap * 0.5 ^ ((now - gap_at) / tonumber(ARGV[6])) end
if sent_at >= regime_at then
  local held = now - regime_at
  local new_gap
  if regime_at > 0 and held >= shortest and held <= longest and went > 0 then
    new_gap = 1.1 * held / went
  elseif gap > 0 and regime_at > 0 then
    new_gap = 1.25 * gap
  else
    new_gap = 100
  end
  redis.call('HSET', state, 'gap_ms', math.min(math.max(new_gap, 1), 10000),
    'gap_at', math.max(until_ms, current), 'regime_at', now, 'regime_sent', 0)
end
redis.call('PEXPIRE', state, tonumber(ARGV[2]))
if until_ms > current then
  redis.call('HSET', state, 'paused_until', until_ms)
  return until_ms
end
return current
