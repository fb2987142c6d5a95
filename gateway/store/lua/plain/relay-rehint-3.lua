--[[
  The relay sweep's hint for queued steps of one tenant in one slot, on a standalone Redis
  (gateway.store.relayq: RelayQueue.sweep). A plain script: no prelude, no trailer.

  There the scripts that write a slot's queue write the tenant's hint in the same atomic step
  (includes/relayq): a hint is missing only when removed by hand. The sweep read the slot's
  due entries earlier; a step may have been claimed (re-scored), re-queued or left the queue
  since. So only a step still queued and without a hint is hinted, at its queue entry's score
  as it is now: the sweep never moves a hint the scripts keep, nor adds one for a step gone.

  Input:
    KEYS[1] the slot's relay queue   fg:rq:{<s>}
    KEYS[2] the tenant's relay hints  fg:relay:t:<tenant>
    KEYS[3] the tenants with hints    fg:relay:tenants
    ARGV[1] the tenant   ARGV[2..] queue members (JSON [tenant, job, step]) of that tenant

  Output: how many hints it wrote.
]]
local n = 0
for i = 2, #ARGV do
  local due = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if due and not redis.call('ZSCORE', KEYS[2], ARGV[i]) then
    redis.call('ZADD', KEYS[2], due, ARGV[i])
    n = n + 1
  end
end
if n > 0 then redis.call('SADD', KEYS[3], ARGV[1]) end
return n
