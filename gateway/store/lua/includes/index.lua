--[[
  The slot's "needs a decision" index: index(key, member, state, score). Included by every
  script that changes a step's state (admit-8, record-4, relay-6, resolve-6, void-5,
  reindex-2).
]]
-- The "needs a decision" index of this slot (fg:nd:{<s>}, the job's slot): a sorted set of
-- queue members [tenant, job, step], holding every step whose outcome is unknown (score:
-- when it became unknown) or that is dispatching (score: its deadline). So ZRANGEBYSCORE
-- -inf <now> finds exactly the steps an operator may have to decide: every unknown, and
-- every dispatch past its deadline. Every script that changes a step's state calls this with
-- the new state, atomically with the change (the per-tenant hint is written after it).
local function index(key, member, state, score)
  if state == 'unknown' or state == 'dispatching' then
    redis.call('ZADD', key, score, member)
  else
    redis.call('ZREM', key, member)
  end
end
