-- Fenced, atomic save of one checkpoint record (store/write/checkpoint.py, RedisCheckpointStore).
--
-- KEYS: record hash, bodies hash, shard events stream, shard in-progress set,
--       shard usage hash, spec key, ledger hash, effects hash, inbox list, approvals hash,
--       session hash (the record key again for a turn of no session), live stream,
--       response key, shard turns index, shard phase counts hash (store/write/save_script.py: SaveKeys names
--       each, SaveCall builds KEYS and ARGV)
-- ARGV: epoch, seq, turn_id, phase, reason, in_progress (1|0), events maxlen,
--       spec value ('' unless this is a submission), replace (1|0: empty the bodies hash
--       first), puts (n), drops (m),
--       tally agent ('' for none), then its six counters (store/domain/usage.py, TALLY_COUNTERS)
--       and the outcome it ends with,
--       ms the keys of a turn this save ends live on (0: for ever; store/domain/retention.py),
--       k, the number of settles,
--       then k call key, dispatched entry, settled entry triples (store/records.py, Settle),
--       then n digest, body pairs, then m digests to drop,
--       then the record's hash fields as field, value, ...
-- Answers: {'exists'} (a submission whose record or spec is already there),
-- {'unreadable', epoch, seq}, {'stale_epoch', epoch, seq} (counted in the shard's usage hash,
-- 'fenced|save': a write of an owner a newer one fenced off), {'already', epoch, seq} (this very
-- record is stored, every field equal: a replay), {'stale_seq', epoch, seq} (also a different
-- record at the same epoch and seq), or {'ok', event id, length of the turn's inbox}.
-- The settles come first and whatever the fence says: each is the outcome of a call the
-- writer dispatched, true whoever owns the turn now, applied as ledger_cas.lua applies an
-- unfenced change (set if the entry is still the writer's dispatch; a replay is a no-op;
-- anything else, a successor's decision, is left). Then the fence is checked before anything
-- else is written, so a refused save changes nothing more: no body is written or dropped
-- (store/write/transcript.py says why that keeps every needed body).
-- A save with a tally that ends the turn (the stored record was in progress) adds the counters
-- to the agent's totals in the shard's usage hash, and counts the outcome there
-- ('outcome|<outcome>'): once per turn, with the record.
-- A save that ends the turn with a time to live sets it on every key of the turn (its live
-- stream and its session's hash too), and trims the shard's turns index and events stream of
-- what is older than that.
-- An accepted save moves the turn in the shard's phase counts (in-progress turns per phase of
-- their latest record): out of the stored record's phase if that was in progress, into its own
-- if it is.
-- Every key shares the turn's hash tag, so this runs unchanged on Redis Cluster.
-- Read as store.write.save_script.SaveStatus (the first word).
local record, bodies = KEYS[1], KEYS[2]
local submission = ARGV[8] ~= ''
if submission and redis.call('EXISTS', record, KEYS[6]) > 0 then
  return {'exists'}
end
local puts, drops = tonumber(ARGV[10]), tonumber(ARGV[11])
local ttl = tonumber(ARGV[20])
local settles = tonumber(ARGV[21])
local head = 22 + 3 * settles  -- the first ARGV after the header, the tally, ttl and settles
local fields = head + 2 * puts + drops  -- the first of the record's field, value pairs
for i = 22, head - 1, 3 do
  if redis.call('HGET', KEYS[7], ARGV[i]) == ARGV[i + 1] then
    redis.call('HSET', KEYS[7], ARGV[i], ARGV[i + 2])
  end
end
-- A save at the stored (epoch, seq) is a replay only if it is this very record, field for
-- field: two resumers that claimed the same epoch at once send the same (epoch, seq) with
-- different content, and the second must be fenced, not told its save landed (its idea of
-- the stored bodies would be wrong).
local function same_record()
  if redis.call('HLEN', record) * 2 ~= #ARGV - fields + 1 then return false end
  for i = fields, #ARGV, 2 do
    if redis.call('HGET', record, ARGV[i]) ~= ARGV[i + 1] then return false end
  end
  return true
end
local stored = redis.call('HMGET', record, 'epoch', 'seq', 'in_progress', 'phase')
if stored[1] or stored[2] then
  local e, s = tonumber(stored[1]), tonumber(stored[2])
  if not e or not s then
    return {'unreadable', stored[1] or '', stored[2] or ''}
  end
  local epoch, seq = tonumber(ARGV[1]), tonumber(ARGV[2])
  if e > epoch then
    redis.call('HINCRBY', KEYS[5], 'fenced|save', 1)
    return {'stale_epoch', stored[1], stored[2]}
  end
  if e == epoch and s == seq and same_record() then return {'already', stored[1], stored[2]} end
  if seq <= s then return {'stale_seq', stored[1], stored[2]} end
end
-- Lua's unpack takes a few thousand values at most: write in slices.
local function each_slice(first, last, width, command, key)
  for i = first, last, width do
    redis.call(command, key, unpack(ARGV, i, math.min(i + width - 1, last)))
  end
end
if ARGV[9] == '1' then redis.call('DEL', bodies) end
local first = head
if ARGV[12] ~= '' and stored[3] == '1' then
  local counters = {'turns', 'prompt', 'completion', 'cached', 'unmetered', 'resumes'}
  for i, name in ipairs(counters) do
    local n = tonumber(ARGV[12 + i])
    if n ~= 0 then redis.call('HINCRBY', KEYS[5], name .. '|' .. ARGV[12], n) end
  end
  if ARGV[19] ~= '' then redis.call('HINCRBY', KEYS[5], 'outcome|' .. ARGV[19], 1) end
end
if puts > 0 then each_slice(first, first + 2 * puts - 1, 1000, 'HSET', bodies) end
first = first + 2 * puts
if drops > 0 then each_slice(first, first + drops - 1, 1000, 'HDEL', bodies) end
first = first + drops
-- The record is rebuilt whole: fields of an older layout (schema 1) must not linger.
redis.call('DEL', record)
redis.call('HSET', record, unpack(ARGV, first))
local id = redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[7], '*',
  'turn_id', ARGV[3], 'epoch', ARGV[1], 'seq', ARGV[2], 'phase', ARGV[4],
  'reason', ARGV[5], 'in_progress', ARGV[6])
if ARGV[6] == '1' then
  redis.call('SADD', KEYS[4], ARGV[3])
else
  redis.call('SREM', KEYS[4], ARGV[3])
end
local was = stored[3] == '1' and stored[4] or false
local now = ARGV[6] == '1' and ARGV[4] or false
if was ~= now then
  if was then redis.call('HINCRBY', KEYS[15], was, -1) end
  if now then redis.call('HINCRBY', KEYS[15], now, 1) end
end
if submission then
  redis.call('SET', KEYS[6], ARGV[8])
  for i = first, #ARGV, 2 do  -- the index orders turns by their first record's updated_at
    if ARGV[i] == 'updated_at' then redis.call('ZADD', KEYS[14], ARGV[i + 1], ARGV[3]) end
  end
end
if ttl > 0 then
  for i = 6, 13 do redis.call('PEXPIRE', KEYS[i], ttl) end
  redis.call('PEXPIRE', record, ttl)
  redis.call('PEXPIRE', bodies, ttl)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  redis.call('ZREMRANGEBYSCORE', KEYS[14], '-inf', '(' .. (now - ttl))
  redis.call('XTRIM', KEYS[3], 'MINID', '~', now - ttl)  -- the shard's checkpoint events too
end
return {'ok', id, redis.call('LLEN', KEYS[9])}
