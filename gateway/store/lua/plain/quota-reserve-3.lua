--[[
  Reserve bytes of a tenant's quota pool (gateway.store.quota_counters: held payloads,
  checkpoints). A plain script: no prelude, no trailer.

  Input:
    KEYS[1] the pool's counter        fg:quota:{<tenant>}:<pool>_bytes
    KEYS[2] its open reservations     fg:quota:{<tenant>}:<pool>_pending  (id -> amount)
    KEYS[3] (optional) this reservation's memory   fg:quota:{<tenant>}:req:<id>
    ARGV[1] amount, ARGV[2] cap (0: none), ARGV[3] ttl seconds, ARGV[4] this reservation's
    id (it starts with when it was made, on Redis's clock: hex ms, then '.'), ARGV[5] how
    long the memory lasts, ms (with KEYS[3])

  The reservation stays open until its settlement closes it; one that is never settled (its
  reply lost on every send, the gateway gone) is given back by the reconciliation once it is
  old (quota-drop-2 on the open reservations). A re-send of a reservation that was made
  finds it open and changes nothing again; one sent in the same pipeline as the admit that
  settles it (admit-6) may find it settled already: with KEYS[3] a made reservation is
  remembered, and its re-send answers what it answered. A refused one wrote nothing (its
  re-send decides anew, and no memory is kept: a flood of refusals stores nothing).

  Output:
    -1      over the cap (nothing changed)
    total   the counter with this amount
]]
local memory = KEYS[3]
if memory then
  local made = redis.call('GET', memory)
  if made then return tonumber(made) end
end
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
if memory then redis.call('SET', memory, total, 'PX', ARGV[5]) end
return total
