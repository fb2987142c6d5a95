--[[
  Settle a checkpoint's reservation after its write (gateway.store.quota_counters). A plain
  script: no prelude, no trailer.

  Input:
    KEYS[1] the checkpoint charges per job   fg:quota:{<tenant>}:ckpt   (job -> charge)
    KEYS[2] ckpt_bytes                       fg:quota:{<tenant>}:ckpt_bytes
    KEYS[3] this call's memory               fg:quota:{<tenant>}:req:<call id>
    KEYS[4] open reservations                fg:quota:{<tenant>}:ckpt_pending (quota-reserve-2)
    ARGV[1] job, ARGV[2] reserved, ARGV[3] what the write stored (its charge minus the one
    it replaced; 0: nothing), ARGV[4] ttl seconds, ARGV[5] memory ms, ARGV[6] the
    reservation's id ('': the write reserved nothing)

  The reservation is closed and becomes what was stored (a reservation the reconciliation
  already gave back is not given back again); the job's entry holds its checkpoints'
  charge. A re-send of the same call changes nothing again.

  Output: 1
]]
--- @include "includes/once"
return once(KEYS[3], ARGV[5], function()
  local reserved = tonumber(ARGV[2])
  if ARGV[6] ~= '' and redis.call('HDEL', KEYS[4], ARGV[6]) == 0 then reserved = 0 end
  local stored = tonumber(ARGV[3])
  local change = stored - reserved
  if change ~= 0 and redis.call('INCRBY', KEYS[2], change) <= 0 then
    redis.call('DEL', KEYS[2])  -- nothing stored, nothing reserved: no key left behind
  end
  if stored ~= 0 and redis.call('HINCRBY', KEYS[1], ARGV[1], stored) <= 0 then
    redis.call('HDEL', KEYS[1], ARGV[1])
  end
  redis.call('EXPIRE', KEYS[1], ARGV[4])
  if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('EXPIRE', KEYS[2], ARGV[4]) end
  return 1
end)
