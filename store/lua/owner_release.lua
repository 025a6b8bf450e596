-- Give the namespace up (store/domain/ownership.py, NamespaceOwner.release): only its owner may.
--
-- KEYS[1]  the namespace's owner hash ({ns}:{global}:owner)
-- ARGV[1]  the owner token
--
-- Returns 1 if the lease was deleted, 0 if someone else holds it (nothing changes).
-- Read as store.domain.ownership.ReleaseAnswer.
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
