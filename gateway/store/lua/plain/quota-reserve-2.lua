--[[
  Reserve bytes of a tenant's quota pool (gateway.store.quota_counters: held payloads,
  checkpoints). A plain script: no prelude, no trailer.

  Input:
    KEYS[1] the pool's counter        fg:quota:{<tenant>}:<pool>_bytes
    KEYS[2] its open reservations     fg:quota:{<tenant>}:<pool>_pending  (id -> amount)
    ARGV[1] amount, ARGV[2] cap (0: none), ARGV[3] ttl seconds, ARGV[4] this reservation's
    id (it starts with when it was made, on Redis's clock: hex ms, then '.')

  The reservation stays open until its settlement closes it; one that is never settled (its
  reply lost on every send, the gateway gone) is given back by the reconciliation once it is
  old (quota-drop-2 on the open reservations). A re-send of a reservation that was made
  finds it open and changes nothing again; a refused one wrote nothing (its re-send decides
  anew).

  Output:
    -1      over the cap (nothing changed)
    total   the counter with this amount
]]
if redis.call('HEXISTS', KEYS[2], ARGV[4]) == 1 then
  return tonumber(redis.call('GET', KEYS[1]) or '0')
end
local total = redis.call('INCRBY', KEYS[1], ARGV[1])
local cap = tonumber(ARGV[2])
if cap > 0 and total > cap then
  if redis.call('INCRBY', KEYS[1], -tonumber(ARGV[1])) <= 0 then redis.call('DEL', KEYS[1]) end
  return -1
end
redis.call('HSET', KEYS[2], ARGV[4], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[3])
return total
