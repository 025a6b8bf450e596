-- Keep a deployment's claim on its namespace (store/domain/ownership.py, NamespaceOwner.renew), from
-- the deployment's Supervisor.
--
-- KEYS[1]  the namespace's owner hash ({ns}:{global}:owner)
-- ARGV[1]  the deployment's Ray cluster id
-- ARGV[2]  the lease's time to live (ms)
-- ARGV[3..] the holder's fields as the Supervisor last read them (field, value, ...), to write
--          back if the lease lapsed while no one else claimed it (Redis away, a slow tick)
--
-- Returns 1 while this cluster holds the namespace (the lease is extended), 0 if another
-- cluster took it over (the caller's deployment must stop: two would run the same turns).
-- Read as store.domain.ownership.RenewAnswer.
local key = KEYS[1]
local cluster = redis.call('HGET', key, 'cluster')
if cluster and cluster ~= ARGV[1] then return 0 end
if not cluster then
  if #ARGV < 4 then return 0 end
  redis.call('HSET', key, unpack(ARGV, 3))
end
redis.call('PEXPIRE', key, ARGV[2])
return 1
