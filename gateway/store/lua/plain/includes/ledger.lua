--[[
  The end of every output ledger script that changes the tenant's bytes (ledger-settle-3,
  ledger-fix-3): ``change`` applied to the sum, no key left once nothing is charged.

    ledger_total(out, out_up, out_bytes, change) -> change

  out: object key -> bytes stored; out_up: "<key> <upload>" -> bytes reserved; out_bytes:
  their sum (the script's KEYS[1], KEYS[2], KEYS[3]).
]]
local function ledger_total(out, out_up, out_bytes, change)
  if change ~= 0 then redis.call('INCRBY', out_bytes, change) end
  if redis.call('HLEN', out) + redis.call('HLEN', out_up) == 0 then
    redis.call('DEL', out_bytes)
  end
  return change
end
