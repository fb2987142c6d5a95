--[[
  Give up an admit whose reply never came (a timeout, a dropped connection that
  could not be re-sent): nothing was sent for it, so it must not hold the step.

  Input (the prelude's trailer follows):
    KEYS[1] effect hash   fg:{t/j}:fx:<step>
    KEYS[2] relay queue of this slot  fg:rq:{<s>}
    KEYS[3] the admit's request key   fg:{t/j}:req:<admit's request id>
    KEYS[4] "needs a decision" index of this slot  fg:nd:{<s>}
    KEYS[5] the tenant's relay hints  fg:relay:t:<tenant>: on a standalone Redis only
            (includes/relayq); absent on a Cluster
    ARGV[1] the admit's dispatch id (its request id)   ARGV[2] retention, seconds
    ARGV[3] queue member (JSON [tenant, job, step])
    ARGV[4] the admit's "run before" (admit-8 ARGV[17]), ms on Redis's clock ('' if none)

  Output:
    {0, 'voided'}    the admit had not run: it never will (it finds {10} remembered)
    {0, 'released'}  it had run and held the step for a dispatch that never started:
                     released (known not delivered; a relay step stays queued, due now:
                     the claim had scored it by its deadline)
    {0, 'unknown'}   it had run to resolve an unknown step: the step is unknown again
    {1, what}        nothing to undo: the admit did not take the step ('answered'),
                     or queued it for the relay ('queued'), or the step moved on

  The admit's request key holds its void mark ({10}), or its remembered reply, at least until
  its "run before" (and the request memory from now): a copy of the admit still on the wire
  finds it, and after the bound the admit refuses to run by itself ({11}), so no copy of a
  voided admit ever runs as a fresh one.

  A step it makes unknown or released is updated in the slot's "needs a decision" index.
]]
--- @include "includes/index"
--- @include "includes/relayq"
local prior = redis.call('GET', KEYS[3])
local fx = redis.call('HMGET', KEYS[1], 'dispatch_id', 'state', 'resolving', 'relay')
-- the dispatch id is unique: a step held under it means the admit (or claim) ran, even when
-- its remembered reply has expired (Redis was away longer than the request memory)
local holds = fx[1] == ARGV[1] and fx[2] == 'dispatching'
local keep = tonumber(REQ_TTL)
local run_before = tonumber(ARGV[4] or '')
if run_before then keep = math.max(keep, run_before - now_ms() + 1) end
if not prior then
  redis.call('SET', KEYS[3], cjson.encode({10}), 'PX', fmt(keep))
  if not holds then return done({0, 'voided'}) end
elseif redis.call('PTTL', KEYS[3]) < keep then
  redis.call('PEXPIRE', KEYS[3], fmt(keep))
end
if prior then
  local verdict = cjson.decode(prior)
  if verdict[1] == 4 then return {1, 'queued'} end
  if verdict[1] ~= 0 then return {1, 'answered'} end
end
if not holds then return {1, fx[2] or ''} end
local now = now_ms()
if fx[3] == '1' then
  -- it was resolving an unknown step: the step is as unknown as it was
  redis.call('HSET', KEYS[1], 'state', 'unknown', 'updated_at', fmt(now), 'deadline', '0')
  index(KEYS[4], ARGV[3], 'unknown', fmt(now))
  return done({0, 'unknown'})
end
redis.call('HSET', KEYS[1], 'state', 'released', 'updated_at', fmt(now), 'deadline', '0',
  'error', '{"reason":"the gateway lost the admit\'s reply and gave the call up: nothing was sent"}')
redis.call('EXPIRE', KEYS[1], ARGV[2])
index(KEYS[4], ARGV[3], 'released')
-- a relay claim given up: the step is queued (the claim scored it, and its hint, by the
-- deadline of a dispatch that never started): due again now, not only at that deadline
if fx[4] == '1' then queue_add(KEYS[2], KEYS[5], ARGV[3], now) end
return done({0, 'released'})
