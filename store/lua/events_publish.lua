-- Publish a batch of one shard's events (store/views/streams.py, RedisBus.publish): the bus events to
-- the shard's bus stream and every event to its turn's live stream, in one call instead of an
-- XADD per event and stream.
--
-- KEYS[1]   the shard's bus stream             ({ns}:{sN}:bus)
-- KEYS[2..] per turn of the batch, its live stream and its checkpoint record
--           ({ns}:{sN}:live:<id>, {ns}:{sN}:turn:<id>)
-- ARGV[1]   the bus stream's approximate cap
-- ARGV[2]   a live stream's approximate cap (0: live streams are off)
-- ARGV[3]   seconds a live stream lives after its last event
-- ARGV[4..] per event, in order: the index in KEYS of its live stream, 1 if it goes to the
--           bus too (else 0), its number of fields n, then n field, value pairs
-- Answers the number of events. A live stream never outlives its record's retention: a record
-- with a time to live (a finished turn's, store/domain/retention.py) caps its stream's, so an event
-- published after the final save does not keep the turn's content a day longer. Every key
-- shares the shard's hash tag, so this runs unchanged on Redis Cluster.
local live_on = ARGV[2] ~= '0'
local i, events = 4, 0
while i <= #ARGV do
  local live, bus, n = tonumber(ARGV[i]), ARGV[i + 1] == '1', tonumber(ARGV[i + 2])
  local first, last = i + 3, i + 2 + 2 * n
  if bus then
    redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', unpack(ARGV, first, last))
  end
  if live_on then
    redis.call('XADD', KEYS[live], 'MAXLEN', '~', ARGV[2], '*', unpack(ARGV, first, last))
  end
  events = events + 1
  i = last + 1
end
if live_on then
  local ttl_ms = tonumber(ARGV[3]) * 1000
  for k = 2, #KEYS, 2 do
    local left = redis.call('PTTL', KEYS[k + 1])
    if left > 0 and left < ttl_ms then
      redis.call('PEXPIRE', KEYS[k], left)
    else
      redis.call('PEXPIRE', KEYS[k], ttl_ms)
    end
  end
end
return events
