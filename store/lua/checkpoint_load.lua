-- Read one checkpoint record and every body it references, in one step
-- (store/write/checkpoint.py, RedisCheckpointStore.load).
--
-- KEYS: record hash, bodies hash; for a turn about to start (RedisCheckpointStore.load_start)
--       also its spec key and inbox list
-- ARGV: none
-- Answers: {} when there is no record, else {record, bodies}: the record's fields as HGETALL
-- gives them, and digest, body, ... for every chunk and entry it names (schema 2; a schema-1
-- record has no chunks or tail and gets no bodies). A body that is not there is left out: the
-- reader finds it missing and quarantines the record. With the two more keys, the answer
-- goes on with the spec (false if there is none) and the inbox's length.
local flat = redis.call('HGETALL', KEYS[1])
if #flat == 0 then return {} end
local chunks, tail
for i = 1, #flat, 2 do
  if flat[i] == 'chunks' then chunks = flat[i + 1] elseif flat[i] == 'tail' then tail = flat[i + 1] end
end
local found = {}
local function split(blob, into)
  for i = 1, #blob - 15, 16 do into[#into + 1] = string.sub(blob, i, i + 15) end
  return into
end
-- HMGET in slices (Lua's unpack takes a few thousand values at most); returns what it found.
local function fetch(digests)
  local got = {}
  for first = 1, #digests, 1000 do
    local last = math.min(first + 999, #digests)
    local values = redis.call('HMGET', KEYS[2], unpack(digests, first, last))
    for i = first, last do
      local body = values[i - first + 1]
      if body then
        found[#found + 1] = digests[i]
        found[#found + 1] = body
        got[#got + 1] = body
      end
    end
  end
  return got
end
if chunks and tail then
  local entries = {}
  for _, chunk in ipairs(fetch(split(chunks, {}))) do split(chunk, entries) end
  fetch(split(tail, entries))
end
if #KEYS == 4 then
  return {flat, found, redis.call('GET', KEYS[3]), redis.call('LLEN', KEYS[4])}
end
return {flat, found}
