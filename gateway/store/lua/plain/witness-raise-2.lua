--[[
  Raise this data dir's witness counter, only next to the durability marker it read
  (gateway.store.link: RedisLink.witness). A plain script: no prelude, no trailer.

  Input:
    KEYS[1] the durability marker   (gateway.store.keys.MARKER)
    KEYS[2] the witness key         fg:witness:<baseline>:<host>
    ARGV[1] the marker's value as read, ARGV[2] the witness key's TTL seconds

  Output:
    -1      the marker no longer reads ARGV[1] (nothing changed)
    value   the counter after the raise
]]
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
local v = redis.call('INCR', KEYS[2])
redis.call('EXPIRE', KEYS[2], ARGV[2])
return v
