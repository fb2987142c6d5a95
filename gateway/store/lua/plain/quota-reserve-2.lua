--[[
  Reserve bytes of a tenant's quota pool (gateway.store.quota_counters: held payloads,
  checkpoints). A plain script: no prelude, no trailer.

  Input:
    KEYS[1] the pool's counter   fg:quota:{<tenant>}:<pool>_bytes
    KEYS[2] this call's memory   fg:quota:{<tenant>}:req:<call id>
    ARGV[1] amount, ARGV[2] cap (0: none), ARGV[3] ttl seconds, ARGV[4] memory ms

  Output (a re-send of the same call: the first run's, nothing changed again):
    -1      over the cap (nothing changed)
    total   the counter with this amount
]]
--- @include "includes/once"
return once(KEYS[2], ARGV[4], function()
  local total = redis.call('INCRBY', KEYS[1], ARGV[1])
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  local cap = tonumber(ARGV[2])
  if cap > 0 and total > cap then
    redis.call('INCRBY', KEYS[1], -tonumber(ARGV[1]))
    return -1
  end
  return total
end)
