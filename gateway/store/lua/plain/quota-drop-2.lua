--[[
  Give back the entries of a tenant's pool whose thing left Redis (gateway.store.quota_counters,
  the reconciliation), or its open reservations that were abandoned. A plain script: no
  prelude, no trailer.

  Input:
    KEYS[1] the pool's hash   fg:quota:{<tenant>}:<pool>   (held, ckpt, or <pool>_pending)
    KEYS[2] its counter       fg:quota:{<tenant>}:<pool>_bytes
    ARGV[1] what the check keys are: 'held' (an effect hash: its payload is back when it
            holds payload_sha), 'ckpt' (a job's checkpoints: back when the key exists), ''
    ARGV[2..] member, charge, check key triples whose thing the reconciliation found gone;
            the check key ('' on a Cluster, where it is another slot, and for reservations)
            is read again here

  Each is dropped only while it still holds that charge and its thing is still gone: a step
  queued again since the reconciliation read it (its charge may be the same) keeps it.

  Output: the bytes given back
]]
local freed = 0
for i = 2, #ARGV, 3 do
  local member, charge, check = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local back = false
  if check ~= '' then
    if ARGV[1] == 'held' then
      back = redis.call('HEXISTS', check, 'payload_sha') == 1
    else
      back = redis.call('EXISTS', check) == 1
    end
  end
  if not back and redis.call('HGET', KEYS[1], member) == charge then
    redis.call('HDEL', KEYS[1], member)
    freed = freed + tonumber(charge)
  end
end
if freed > 0 then redis.call('INCRBY', KEYS[2], -freed) end
return freed
