-- Fenced compare-and-set of tool ledger entries (store/domain/ledger.py, ToolLedger.transition).
--
-- KEYS[1]  the turn's checkpoint record hash   ({ns}:{sN}:turn:<id>)
-- KEYS[2]  the turn's tool ledger hash          ({ns}:{sN}:tools:<id>)
-- KEYS[3]  the shard's counters hash            ({ns}:{sN}:usage, store/domain/usage.py)
-- ARGV[1]  the caller's epoch, or '' for an unfenced write (a dispatched call's own outcome)
-- ARGV[2..] triples: call key, expected current value, new value
--
-- A fenced call is refused as a whole when the record's stored epoch is not the caller's, and
-- the refusal is counted in the shard's counters ('fenced|cas'):
--   -> {'fenced', stored epoch or ''}
-- Otherwise each triple is applied on its own, in order:
--   the field holds the expected value -> it is set to the new value   -> 1
--   the field already holds the new value (a replay of this very call) -> 1
--   anything else (another writer got there first): left as it is     -> 0
--   -> {'ok', r1, r2, ...}
-- All keys share the turn's hash tag, so this runs unchanged on Redis Cluster.
-- Read as store.domain.ledger.LedgerAnswer (the first word).
if ARGV[1] ~= '' then
  local stored = redis.call('HGET', KEYS[1], 'epoch')
  if stored ~= ARGV[1] then
    redis.call('HINCRBY', KEYS[3], 'fenced|cas', 1)
    return {'fenced', stored or ''}
  end
end
local out = {'ok'}
for i = 2, #ARGV, 3 do
  local current = redis.call('HGET', KEYS[2], ARGV[i])
  if current == ARGV[i + 1] then
    redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 2])
    out[#out + 1] = 1
  elseif current == ARGV[i + 2] then
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
