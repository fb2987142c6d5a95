--[[
  Reserve an upload's bytes in the tenant's output ledger (gateway.store.output_records). A
  plain script: no prelude, no trailer.

  Input:
    KEYS[1] out         fg:quota:{<tenant>}:out         (object key -> bytes stored)
    KEYS[2] out_up      fg:quota:{<tenant>}:out_up      ("<key> <upload>" -> bytes reserved)
    KEYS[3] out_bytes   fg:quota:{<tenant>}:out_bytes   (their sum)
    ARGV[1] object key, ARGV[2] upload id, ARGV[3] bytes, ARGV[4] byte cap, ARGV[5] object
    cap (0: none), ARGV[6] the reservation this one takes over ('"<key> <upload>"', '': none;
    a new URL for the output replacing the last one)

  Output:
    -1      over the byte cap (nothing changed)
    -2      over the object cap (nothing changed)
    total   the tenant's bytes with this reservation
]]
local field = ARGV[1] .. ' ' .. ARGV[2]
local amount = tonumber(ARGV[3])
local taken, old = 0, 0
if ARGV[6] ~= '' and redis.call('HEXISTS', KEYS[2], ARGV[6]) == 1 then
  taken, old = 1, tonumber(redis.call('HGET', KEYS[2], ARGV[6]))
end
local objects = tonumber(ARGV[5])
if objects > 0 and redis.call('HEXISTS', KEYS[2], field) == 0 then
  local n = redis.call('HLEN', KEYS[1]) + redis.call('HLEN', KEYS[2]) + 1 - taken
  if n - redis.call('HEXISTS', KEYS[1], ARGV[1]) > objects then return -2 end
end
local total = tonumber(redis.call('GET', KEYS[3]) or '0') + amount - old
local cap = tonumber(ARGV[4])
if cap > 0 and amount > old and total > cap then return -1 end
if taken == 1 then redis.call('HDEL', KEYS[2], ARGV[6]) end
redis.call('HINCRBY', KEYS[2], field, amount)
redis.call('INCRBY', KEYS[3], amount - old)
return total
