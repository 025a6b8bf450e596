-- Remove a finished turn now (store/domain/retention.py, TurnPurger.purge).
--
-- KEYS: record hash, bodies hash, spec, ledger hash, effects hash, inbox list, approvals hash,
--       live stream, response key, shard turns index
-- ARGV[1]  the turn id
--
-- Deletes every key of the turn and its index entry, in one step, unless the record is in
-- progress (a running or resumable turn is never purged; a suspended one is not in progress
-- and may be). Returns 1 when purged, 0 when in progress or not there.
-- Read as store.domain.retention.PurgeAnswer.
local state = redis.call('HGET', KEYS[1], 'in_progress')
if not state or state == '1' then return 0 end
for i = 1, 9 do redis.call('DEL', KEYS[i]) end
redis.call('ZREM', KEYS[10], ARGV[1])
return 1
