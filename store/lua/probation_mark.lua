-- Update or clear the probation marker, but only while it is still the caller's
-- (store/domain/isolation.py, Isolation.step and Isolation.end).
--
-- KEYS: probation hash
-- ARGV: op ('step' | 'end'), turn_id, epoch, step, at (unix ms)
-- Answers 1 if the marker was this turn's probation at this epoch (and was updated or
-- deleted), else 0: a zombie incarnation can neither move nor clear its successor's marker.
-- Read as store.domain.isolation.MarkAnswer.
local m = redis.call('HMGET', KEYS[1], 'turn_id', 'epoch')
if m[1] ~= ARGV[2] or m[2] ~= ARGV[3] then
  return 0
end
if ARGV[1] == 'end' then
  redis.call('DEL', KEYS[1])
else
  redis.call('HSET', KEYS[1], 'step', ARGV[4], 'at', ARGV[5])
end
return 1
