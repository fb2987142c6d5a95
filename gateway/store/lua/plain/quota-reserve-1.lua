--[[
  Reserve bytes of a tenant's quota pool (gateway.store.quota_counters: held payloads,
  checkpoints). A plain script: no prelude, no trailer.

  Input:
    KEYS[1] the pool's counter   fg:quota:{<tenant>}:<pool>_bytes
    ARGV[1] amount, ARGV[2] cap (0: none), ARGV[3] ttl seconds

  Output:
    -1      over the cap (nothing changed)
    total   the counter with this amount
]]
local total = redis.call('INCRBY', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[3])
local cap = tonumber(ARGV[2])
if cap > 0 and total > cap then
  redis.call('INCRBY', KEYS[1], -tonumber(ARGV[1]))
  return -1
end
return total
