--[[
  Settle a held payload's reservation after the admit's verdict (gateway.store.quota_counters).
  A plain script: no prelude, no trailer.

  Input:
    KEYS[1] held hash      fg:quota:{<tenant>}:held           ([job, step] -> charge)
    KEYS[2] held_bytes     fg:quota:{<tenant>}:held_bytes
    KEYS[3] this call's memory   fg:quota:{<tenant>}:req:<call id>
    KEYS[4] open reservations    fg:quota:{<tenant>}:held_pending   (quota-reserve-2)
    ARGV[1] member, ARGV[2] charge, ARGV[3] '1': stored, ARGV[4] ttl seconds,
    ARGV[5] memory ms, ARGV[6] the reservation's id

  The reservation is closed. Stored: the member now holds this charge (an earlier charge of
  it is given back; a reservation the reconciliation already gave back is counted again);
  not stored: the reservation is given back (unless the reconciliation did). A re-send of
  the same call changes nothing again.

  Output: 1
]]
--- @include "includes/once"
return once(KEYS[3], ARGV[5], function()
  local open = redis.call('HDEL', KEYS[4], ARGV[6])
  local charge = tonumber(ARGV[2])
  local change = 0
  if ARGV[3] == '1' then
    local old = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
    redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
    change = -old
    if open == 0 then change = change + charge end
  elseif open == 1 then
    change = -charge
  end
  if change ~= 0 and redis.call('INCRBY', KEYS[2], change) <= 0 then
    redis.call('DEL', KEYS[2])
  end
  redis.call('EXPIRE', KEYS[1], ARGV[4])
  if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('EXPIRE', KEYS[2], ARGV[4]) end
  return 1
end)
