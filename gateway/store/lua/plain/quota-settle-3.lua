--[[
  Settle a held payload's reservation after the admit's verdict (gateway.store.quota_counters).
  A plain script: no prelude, no trailer.

  Input:
    KEYS[1] held hash    fg:quota:{<tenant>}:held   ([job, step] -> charge)
    KEYS[2] held_bytes   fg:quota:{<tenant>}:held_bytes
    KEYS[3] this call's memory   fg:quota:{<tenant>}:req:<call id>
    ARGV[1] member, ARGV[2] charge, ARGV[3] '1': stored, ARGV[4] ttl seconds,
    ARGV[5] memory ms

  Stored: the member now holds this charge (an earlier charge of it is given back); not
  stored: the reservation is given back. A re-send of the same call changes nothing again.

  Output: 1
]]
--- @include "includes/once"
return once(KEYS[3], ARGV[5], function()
  if ARGV[3] == '1' then
    local old = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
    redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
    if old > 0 then redis.call('INCRBY', KEYS[2], -old) end
  else
    redis.call('INCRBY', KEYS[2], -tonumber(ARGV[2]))
  end
  redis.call('EXPIRE', KEYS[1], ARGV[4])
  redis.call('EXPIRE', KEYS[2], ARGV[4])
  return 1
end)
