-- Claim a tool batch (store/domain/ledger.py, ToolLedger.claim): journal the model reply that asked
-- for it, journal its calls and take the fenced step of every new one, in one round trip.
--
-- KEYS[1]  the turn's checkpoint record hash   ({ns}:{sN}:turn:<id>)
-- KEYS[2]  the turn's tool ledger hash          ({ns}:{sN}:tools:<id>)
-- KEYS[3]  the shard's counters hash            ({ns}:{sN}:usage, store/domain/usage.py)
-- ARGV[1]  the caller's epoch
-- ARGV[2]  the ledger field of the journaled reply (store.keys.REPLY_FIELD)
-- ARGV[3]  the journaled reply (msgpack ReplyJournal), or '' to leave the field as it is
-- ARGV[4..] triples: call key, its 'prepared' entry, the entry the owner decided for a call
--           the ledger does not hold yet ('dispatched' to run it, or its settled result)
--
-- Fenced as a whole: when the record's stored epoch is not the caller's, each new call is
-- only journaled 'prepared' (as an unfenced prepare would) and nothing else is written (the
-- reply neither: a fenced owner's reply is never continued from), and the refusal is counted
-- in the shard's counters ('fenced|claim'):
--   -> {'fenced', stored epoch or ''}
-- Otherwise the reply is set (before any call is decided, so no call of it runs unless it is
-- durable), then, per triple in order:
--   the call is new     -> its decided entry is set: the caller won it            -> 1
--   the call is there   -> left as it is; its stored bytes come back, for the caller to
--                          decide from them (ledger_cas.lua)                      -> bytes
--   -> {'ok', r1, r2, ...}
-- A new call's decided entry goes in with the fence check, so no other writer can come between
-- them: exactly what 'prepared' then a compare-and-set to 'dispatched' gives, in one step.
-- All keys share the turn's hash tag, so this runs unchanged on Redis Cluster.
-- Read as store.domain.ledger.LedgerAnswer (the first word).
local stored = redis.call('HGET', KEYS[1], 'epoch')
if stored ~= ARGV[1] then
  for i = 4, #ARGV, 3 do
    redis.call('HSETNX', KEYS[2], ARGV[i], ARGV[i + 1])
  end
  redis.call('HINCRBY', KEYS[3], 'fenced|claim', 1)
  return {'fenced', stored or ''}
end
if ARGV[3] ~= '' then
  redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
end
local out = {'ok'}
for i = 4, #ARGV, 3 do
  local current = redis.call('HGET', KEYS[2], ARGV[i])
  if current then
    out[#out + 1] = current
  else
    redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 2])
    out[#out + 1] = 1
  end
end
return out
