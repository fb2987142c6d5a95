--[[
  The due entries of many slots' sorted sets of one kind, read only (gateway.store.slotscan:
  the relay's sweep of its queues, the attention reconciler's read of its index). A plain
  script: no prelude, no trailer. On a standalone Redis only: its keys are many slots.

  Input:
    KEYS[i]    one slot's sorted set (fg:rq:{<s>} or fg:nd:{<s>})
    ARGV[1]    the highest score due (ms)
    ARGV[2]    entries read per key at most
    ARGV[3]    entries read per call at most: the keys after the one that reached it are
               left for the next call
    ARGV[3+i]  the offset to read KEYS[i] from (its entries before were read already); all
               0 when there is no ARGV[4]

  Output: {keys read, i, {member, score, ...}, i, {...}, ...}: how many keys were read (the
  caller sends the rest again), then each key with due entries, by its position in KEYS,
  and its entries in score order (scores as text).
]]
local due, per_key, budget = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local offsets = #ARGV > 3
local out = {0}
local total = 0
for i = 1, #KEYS do
  local rows = redis.call('ZRANGEBYSCORE', KEYS[i], '-inf', due, 'WITHSCORES', 'LIMIT',
    offsets and ARGV[3 + i] or 0, per_key)
  out[1] = i
  if #rows > 0 then
    out[#out + 1] = i
    out[#out + 1] = rows
    total = total + #rows / 2
    if total >= budget then break end
  end
end
return out
