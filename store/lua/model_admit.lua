-- Admission of one model call to an endpoint, shared by every host and process
-- (store/domain/limiter.py, EndpointLimiter.admit). Times are the server's (TIME), so hosts whose
-- clocks differ still share one schedule.
--
-- KEYS[1]  the endpoint's state hash ({ns}:{m:<id>}:limit): tat_req, tat_tok (ms, GCRA
--          theoretical arrival times), paused_until (ms), gap_ms and gap_at (the spacing a
--          provider's refusals set, model_pause.lua), regime_at and regime_sent (when that
--          spacing was set, calls admitted since), label, back:<ticket> (ms by which a
--          waiter said it would ask again)
-- KEYS[2]  the endpoint's waiting line, a zset: ticket -> ms of its first refusal
-- KEYS[3]  the endpoint's calls in flight, a zset: ticket -> ms its hold expires
-- ARGV[1]  ticket (one model call of one turn; asked again with each retry of that call)
-- ARGV[2]  ms between requests (60000 / requests per minute); 0: no request limit
-- ARGV[3]  requests that may go at once (the burst, >= 1)
-- ARGV[4]  ms per token (60000 / tokens per minute); 0: no token limit
-- ARGV[5]  the call's estimated tokens
-- ARGV[6]  calls in flight at most; 0: no limit
-- ARGV[7]  ms an admitted call holds its in-flight place at most (a caller that died)
-- ARGV[8]  ms a waiter may be late asking again before it leaves the line (it ended or died)
-- ARGV[9]  a label a person can read (model and base URL), kept in the state hash
-- ARGV[10] ms the endpoint's keys live after its last call (store/domain/limiter.py, STATE_KEEP_MS)
-- ARGV[11] ms in which a spacing set by refusals halves (store/domain/limiter.py, GAP_HALF_LIFE_MS)
-- ARGV[12] ms between the first calls to an endpoint that declared no rate (FIRST_GAP_MS)
--
-- A call is admitted when the endpoint is not paused (a provider's 429 paused it), the
-- request and token schedules have room (GCRA: one minute of tokens may go at once), a place
-- in flight is free, and no one who waited longer is still waiting: the line is served in the
-- order of first refusal, so new calls do not starve old ones. Returns 0 when admitted (the
-- schedules advance, the ticket takes a place in flight), else the ms to wait before asking
-- again (the ticket keeps its place in the line). An admitted call is counted in
-- regime_sent, the calls sent under the current spacing (model_pause.lua reads it).
local state, line, flight = KEYS[1], KEYS[2], KEYS[3]
local ticket = ARGV[1]
local req_ms, burst = tonumber(ARGV[2]), tonumber(ARGV[3])
local tok_ms, tokens = tonumber(ARGV[4]), tonumber(ARGV[5])
local max_flight, hold_ms, grace_ms = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local keep_ms = tonumber(ARGV[10])
-- An endpoint met for the first time (or unused for the life of its state) that declared no
-- rate: its first calls go at most one per ARGV[12] ms, a spacing that halves like any other,
-- so a burst of turns does not meet the provider's limit all at once, before a refusal
-- says where that limit is (every call sent at once beyond it is a refusal too).
if redis.call('HSETNX', state, 'label', ARGV[9]) == 1 and req_ms == 0 then
  redis.call('HSET', state, 'gap_ms', ARGV[12], 'gap_at', now)
end

-- a waiter that did not come back when it said it would (its turn ended, its host died)
-- leaves the head of the line, so it holds no one up
while true do
  local head = redis.call('ZRANGE', line, 0, 0)[1]
  if not head then break end
  local back = tonumber(redis.call('HGET', state, 'back:' .. head) or '0')
  if head == ticket or now <= back + grace_ms then break end
  redis.call('ZREM', line, head)
  redis.call('HDEL', state, 'back:' .. head)
end
redis.call('ZREMRANGEBYSCORE', flight, '-inf', now)

local wait = 0
local paused = tonumber(redis.call('HGET', state, 'paused_until') or '0')
if paused > now then wait = paused - now end
-- after a provider's refusal, calls to an endpoint that declared no request rate go at most
-- one per gap (the provider's rate as model_pause.lua measured it), with half a second of
-- them allowed at once so a waiter that asks late does not lose its slot (a declared rate
-- already spaces them: a rare refusal under it only pauses); the gap halves every ARGV[11] ms
-- from the end of the pause, forgotten below 5 ms
local gap = tonumber(redis.call('HGET', state, 'gap_ms') or '0')
if req_ms > 0 then gap = 0 end
if gap > 0 then
  local gap_at = tonumber(redis.call('HGET', state, 'gap_at') or '0')
  if now > gap_at then gap = gap * 0.5 ^ ((now - gap_at) / tonumber(ARGV[11])) end
  if gap < 5 then
    redis.call('HDEL', state, 'gap_ms', 'gap_at')
    gap = 0
  end
end
local step = math.max(req_ms, gap)
if gap > req_ms then burst = math.max(1, math.min(10, math.floor(500 / gap))) end
-- the schedule starts again at the pause's end, without what it saved up before: the
-- provider's bucket was empty when it refused
local tat_req = math.max(tonumber(redis.call('HGET', state, 'tat_req') or '0'), now)
if step > 0 then
  tat_req = math.max(tat_req, paused + step * (burst - 1))
  wait = math.max(wait, tat_req - step * (burst - 1) - now)
end
local tat_tok = math.max(tonumber(redis.call('HGET', state, 'tat_tok') or '0'), now)
local cost = tok_ms * tokens
if tok_ms > 0 then
  wait = math.max(wait, tat_tok + cost - 60000 - now)
end
if max_flight > 0 and redis.call('ZCARD', flight) >= max_flight then
  wait = math.max(wait, 200)  -- calls finish at their own pace: ask again soon
end
local rank = redis.call('ZRANK', line, ticket)
local ahead = rank
if not ahead then ahead = redis.call('ZCARD', line) end
if ahead > 0 then
  -- everyone ahead goes first: at least one request interval each (a short beat without one)
  wait = math.max(wait, 0) + ahead * math.max(step, 10)
end

if wait <= 0 then
  if step > 0 then redis.call('HSET', state, 'tat_req', tat_req + step) end
  if tok_ms > 0 then redis.call('HSET', state, 'tat_tok', tat_tok + cost) end
  if max_flight > 0 then redis.call('ZADD', flight, now + hold_ms, ticket) end
  redis.call('HINCRBY', state, 'regime_sent', 1)
  redis.call('ZREM', line, ticket)
  redis.call('HDEL', state, 'back:' .. ticket)
  redis.call('PEXPIRE', state, keep_ms)
  redis.call('PEXPIRE', flight, keep_ms)
  return 0
end
wait = math.max(1, math.ceil(wait))
if not rank then redis.call('ZADD', line, now, ticket) end
redis.call('HSET', state, 'back:' .. ticket, now + wait)
redis.call('PEXPIRE', state, keep_ms)
redis.call('PEXPIRE', line, keep_ms)
return wait
