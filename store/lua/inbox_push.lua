-- Append to a turn's inbox only while the turn runs (store/domain/inbox.py, Inbox.push).
--
-- KEYS[1]  the turn's checkpoint record hash
-- KEYS[2]  the turn's inbox list
-- ARGV[1]  the msgpack InboxItem
--
-- Returns 1 when appended; 0 when the turn is not in progress (finished or suspended: no
-- incarnation would ever read it); -1 when there is no such turn. Both keys share the turn's
-- hash tag, so this runs on Redis Cluster.
-- Read as store.domain.inbox.PushAnswer.
local state = redis.call('HGET', KEYS[1], 'in_progress')
if not state then return -1 end
if state ~= '1' then return 0 end
redis.call('RPUSH', KEYS[2], ARGV[1])
return 1
