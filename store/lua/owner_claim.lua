-- Claim the namespace for a deployment (store/domain/ownership.py, NamespaceOwner.claim).
--
-- KEYS[1]  the namespace's owner hash ({ns}:{global}:owner): cluster, owner, host, pid,
--          command, since (ms), auth
-- ARGV[1]  the claimer's Ray cluster id ("in-process:<host>:<pid>" for one process)
-- ARGV[2]  the claimer's owner token (one per Runtime that may own the deployment)
-- ARGV[3]  its host name, ARGV[4] its pid, ARGV[5] its command
-- ARGV[6]  the lease's time to live (ms)
-- ARGV[7]  '' to claim a free namespace only, else the owner token the claimer replaces (a
--          takeover of its own cluster's deployment whose owner process is gone)
-- ARGV[8]  '1' when that takeover may cross clusters: the holder ran its turns in its own
--          process (cluster "in-process:..."), and that process is gone
-- ARGV[9]  how the claimer's Ray cluster authenticates ('token', 'none'; '' in process)
--
-- Returns {'acquired'} when the claimer now owns the namespace (the hash is written and
-- expires in ARGV[6] ms unless renewed), else {'held', <the holder's fields, flat>}: another
-- Ray cluster holds it, or this cluster's deployment has another owner.
-- Read as store.domain.ownership.OwnerClaimAnswer (the first word).
local key = KEYS[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function write()
  redis.call('HSET', key, 'cluster', ARGV[1], 'owner', ARGV[2], 'host', ARGV[3],
    'pid', ARGV[4], 'command', ARGV[5], 'since', now, 'auth', ARGV[9])
  redis.call('PEXPIRE', key, ARGV[6])
  return {'acquired'}
end
if redis.call('EXISTS', key) == 0 then return write() end
local held = redis.call('HGETALL', key)
if ARGV[7] ~= '' and (ARGV[8] == '1' or redis.call('HGET', key, 'cluster') == ARGV[1])
    and redis.call('HGET', key, 'owner') == ARGV[7] then
  return write()
end
local out = {'held'}
for _, v in ipairs(held) do out[#out + 1] = v end
return out
