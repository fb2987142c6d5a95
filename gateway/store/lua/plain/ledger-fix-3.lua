--[[
  Repair the tenant's output ledger against what the output store holds
  (gateway.store.output_records, the sweeper). A plain script: no prelude, no trailer.

  Input:
    KEYS[1] out, KEYS[2] out_up, KEYS[3] out_bytes (as ledger-reserve-3)
    ARGV    triples (op, field, value): 'o' drop out's field if it holds value; 'u' drop
            out_up's field if it holds value; 's' charge the object key field at value if it
            is not charged; 'O' drop out's field, 'U' drop out_up's field, whatever they hold
            (deleted objects)

  Output: the change of the tenant's bytes
]]
--- @include "includes/ledger"
local change = 0
for i = 1, #ARGV, 3 do
  local op, field, value = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local h = (op == 'o' or op == 'O' or op == 's') and KEYS[1] or KEYS[2]
  local held = redis.call('HGET', h, field)
  if op == 's' then
    if not held then
      redis.call('HSET', h, field, value)
      change = change + tonumber(value)
    end
  elseif held and (op == 'O' or op == 'U' or held == value) then
    redis.call('HDEL', h, field)
    change = change - tonumber(held)
  end
end
return ledger_total(KEYS[1], KEYS[2], KEYS[3], change)
