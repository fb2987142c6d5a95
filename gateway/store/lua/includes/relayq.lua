--[[
  The relay's queue entry of a step, written in the same atomic step as the step's state:
  the slot's queue (fg:rq:{<s>}, the truth) and, on a standalone Redis, the tenant's hint
  (fg:relay:t:<tenant>, what the relay reads, fair across tenants), with the same member and
  score. Included by every script that queues, re-schedules or drops a step (admit-8,
  record-4, relay-6, resolve-6, void-5).

    queue_add(queue, hint, member, due)   queue_remove(queue, hint, member)

  hint: the tenant's hint key, the script's key after its own; nil on a Cluster, where it is
  another slot's key: the gateway writes the hint after the script there, and the relay's
  sweep of every slot's queue finds one lost in a crash. So on a standalone Redis a tenant's
  hints are exactly its steps in the slots' queues: none is lost in a crash, none is left
  behind, and the sweep has nothing to find.
]]
local function queue_add(queue, hint, member, due)
  redis.call('ZADD', queue, due, member)
  if hint then redis.call('ZADD', hint, due, member) end
end

local function queue_remove(queue, hint, member)
  redis.call('ZREM', queue, member)
  if hint then redis.call('ZREM', hint, member) end
end
