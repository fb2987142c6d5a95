--[[
  Settle an upload in the tenant's output ledger (gateway.store.output_records). A plain
  script: no prelude, no trailer.

  Input:
    KEYS[1] out, KEYS[2] out_up, KEYS[3] out_bytes (as ledger-reserve-3)
    ARGV[1] object key, ARGV[2] upload id, ARGV[3] the object's size ('': nothing stored)

  The upload's reservation is given back; stored, the key holds its size (what it held
  before is given back: the object was replaced).

  Output: the change of the tenant's bytes
]]
--- @include "includes/ledger"
local field = ARGV[1] .. ' ' .. ARGV[2]
local change = -tonumber(redis.call('HGET', KEYS[2], field) or '0')
redis.call('HDEL', KEYS[2], field)
if ARGV[3] ~= '' then
  change = change + tonumber(ARGV[3]) - tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
end
return ledger_total(KEYS[1], KEYS[2], KEYS[3], change)
