--[[
  Give back the entries of a tenant's pool whose thing left Redis (gateway.store.quota_counters,
  the reconciliation). A plain script: no prelude, no trailer.

  Input:
    KEYS[1] the pool's hash   fg:quota:{<tenant>}:<pool>   (held or ckpt)
    KEYS[2] its counter       fg:quota:{<tenant>}:<pool>_bytes
    ARGV    member, charge pairs whose thing is gone

  Each is dropped only while it still holds that charge.

  Output: the bytes given back
]]
local freed = 0
for i = 1, #ARGV, 2 do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then
    redis.call('HDEL', KEYS[1], ARGV[i])
    freed = freed + tonumber(ARGV[i + 1])
  end
end
if freed > 0 then redis.call('INCRBY', KEYS[2], -freed) end
return freed
