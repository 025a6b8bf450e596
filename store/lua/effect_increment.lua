-- One run of a non-idempotent tool's side effect (store/domain/effects.py, EffectCounters.increment).
--
-- KEYS[1]  the turn's effects hash ({ns}:{sN}:effects:<id>)
-- ARGV[1]  the call key
-- ARGV[2]  a random id of this run of the tool body
--
-- Counts the run once even if the command is sent twice (a client retry after a lost reply):
-- the marker field '#<call key>#<run id>' is set only by the first copy.
-- Returns how many distinct runs the call key has had.
local marker = '#' .. ARGV[1] .. '#' .. ARGV[2]
if redis.call('HSETNX', KEYS[1], marker, '1') == 1 then
  return redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
end
return tonumber(redis.call('HGET', KEYS[1], ARGV[1]))
