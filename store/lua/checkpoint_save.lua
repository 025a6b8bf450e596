-- Fenced, atomic save of one checkpoint record (store/checkpoint.py, RedisCheckpointStore).
--
-- KEYS: record hash, shard events stream, shard in-progress set [, spec key of a submission]
-- ARGV: epoch, seq, turn_id, phase, reason, in_progress (1|0), events maxlen,
--       spec value (or ''), then the record's hash fields as field, value, ...
-- Answers: {'exists'} (a submission whose record or spec is already there),
-- {'unreadable', epoch, seq}, {'stale_epoch', epoch, seq}, {'already', epoch, seq} (this very
-- save is stored: a replay), {'stale_seq', epoch, seq}, or {'ok', event id}.
-- Every key shares the turn's hash tag, so this runs unchanged on Redis Cluster.
local record = KEYS[1]
if KEYS[4] and redis.call('EXISTS', record, KEYS[4]) > 0 then
  return {'exists'}
end
local stored = redis.call('HMGET', record, 'epoch', 'seq')
if stored[1] or stored[2] then
  local e, s = tonumber(stored[1]), tonumber(stored[2])
  if not e or not s then
    return {'unreadable', stored[1] or '', stored[2] or ''}
  end
  local epoch, seq = tonumber(ARGV[1]), tonumber(ARGV[2])
  if e > epoch then return {'stale_epoch', stored[1], stored[2]} end
  if e == epoch and s == seq then return {'already', stored[1], stored[2]} end
  if seq <= s then return {'stale_seq', stored[1], stored[2]} end
end
redis.call('HSET', record, unpack(ARGV, 9))
local id = redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[7], '*',
  'turn_id', ARGV[3], 'epoch', ARGV[1], 'seq', ARGV[2], 'phase', ARGV[4],
  'reason', ARGV[5], 'in_progress', ARGV[6])
if ARGV[6] == '1' then
  redis.call('SADD', KEYS[3], ARGV[3])
else
  redis.call('SREM', KEYS[3], ARGV[3])
end
if KEYS[4] then redis.call('SET', KEYS[4], ARGV[8]) end
return {'ok', id}
