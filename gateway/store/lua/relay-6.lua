--[[
  The relay claims a queued step: pending (or released by an earlier relay attempt)
  -> dispatching, for exactly one relay, under the fence like any other dispatch.

  Input (the prelude's trailer follows):
    KEYS[1] effect hash       fg:{t/j}:fx:<step>
    KEYS[2] job hash          fg:{t/j}:job
    KEYS[3] job audit stream  fg:{t/j}:audit
    KEYS[4] relay queue of this slot  fg:rq:{<s>}
    KEYS[5] "needs a decision" index of this slot  fg:nd:{<s>}   (member: ARGV[4])
    KEYS[6] the tenant's relay hints  fg:relay:t:<tenant>: on a standalone Redis only
            (includes/relayq); absent on a Cluster
    ARGV[1] dispatch id (= this call's request id)   ARGV[2] dispatch timeout, ms
    ARGV[3] retention, seconds   ARGV[4] queue member (JSON [tenant, job, step])
    ARGV[5] job id   ARGV[6] step   ARGV[7] tenant
    ARGV[8] run before, ms on Redis's clock ('' for no bound): arriving later, the claim does
            nothing ({11}); a void of it (void-5) outlives this bound

  Output:
    {0, dispatch_id, generation, adapter, operation, payload, deadline_ms}   claimed (a
                       re-sent claim is answered with payload '': the gateway reads it from
                       the effect hash, where it stays while the claim holds the step)
    {2, deadline_ms}   another dispatch holds the step: look again after its deadline (on a
                       standalone Redis the hint already says when: the queue entry's score)
    {3, why, audit_id} nothing to send; the step left the queue. why: its state (done,
                       resolved, re-pinned), 'unqueued', 'cancelled', 'job_completed'
                       (released, audited), 'superseded' (below the fence: released,
                       audited), 'lease_expired' (released, audited),
                       'unbound' (the payload is not the pinned intent's: released)
    {11, now_ms}       too late: it arrived after ARGV[8]; nothing was done

  The claim re-checks, atomically, what the admit checked: the job is not cancelled nor
  completed, the step's generation is the fence, its lease has not run out, and the stored
  payload belongs to the pinned intent. A step that fails a check is never sent.
  Every state change of the step updates the slot's "needs a decision" index (index()).
]]
--- @include "includes/audit"
--- @include "includes/index"
--- @include "includes/relayq"
local now = now_ms()
local run_before = tonumber(ARGV[8] or '')
if run_before and now > run_before then return {11, fmt(now)} end
local member = ARGV[4]
if not redis.call('ZSCORE', KEYS[4], member) then
  -- a hint the gateway wrote after the step left the queue (after a {2}): dropped here
  if KEYS[6] and redis.call('ZREM', KEYS[6], member) == 1 then
    return done({3, 'unqueued', ''})
  end
  return {3, 'unqueued', ''}
end
local fx = redis.call('HMGET', KEYS[1], 'state', 'deadline', 'generation', 'adapter',
  'operation', 'payload', 'payload_sha', 'intent_sha256', 'relay', 'worker_id')
local state = fx[1]

local function leave(why, audit_id)
  queue_remove(KEYS[4], KEYS[6], member)
  return done({3, why, audit_id or ''})
end

if state == 'dispatching' then
  local deadline = tonumber(fx[2]) or 0
  if now < deadline then
    -- held: the hint is the queue entry (scored by the holder's deadline, or by the retry
    -- the holder queued since); one left due by an older gateway's claim is moved to it
    local due = redis.call('ZSCORE', KEYS[4], member)
    if KEYS[6] and redis.call('ZSCORE', KEYS[6], member) ~= due then
      redis.call('ZADD', KEYS[6], due, member)
      return done({2, fmt(deadline)})
    end
    return {2, fmt(deadline)}
  end
  -- the dispatcher died or stalled past its deadline: the outcome is not known
  redis.call('HSET', KEYS[1], 'state', 'unknown', 'updated_at', fmt(now),
    'error', '{"reason":"dispatch deadline passed without a recorded outcome"}')
  redis.call('HDEL', KEYS[1], 'payload', 'payload_sha', 'relay')
  index(KEYS[5], member, 'unknown', fmt(now))
  return leave('unknown')
end
-- pending, or released by an earlier relay attempt (payload kept): claim it
if not (state == 'pending' or (state == 'released' and fx[9] == '1')) then
  return leave(state or '')
end

local function release(reason, why, audit_reason, current)
  redis.call('HSET', KEYS[1], 'state', 'released', 'updated_at', fmt(now),
    'error', cjson.encode({reason = reason}))
  redis.call('HDEL', KEYS[1], 'payload', 'payload_sha', 'relay')
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  index(KEYS[5], member, 'released')
  local id = ''
  if audit_reason then
    id = audit(KEYS[3], KEYS[2], ARGV[3], now, {
      'tenant', ARGV[7], 'job_id', ARGV[5], 'step', ARGV[6], 'reason', audit_reason,
      'presented', fx[3] or '', 'current', current, 'worker_id', fx[10] or '',
      'adapter', fx[4] or ''})
  end
  return leave(why, id)
end

local job = redis.call('HMGET', KEYS[2], 'fence', 'cancelled', 'lease_exp')
local fence = tonumber(job[1]) or 0
local gen = tonumber(fx[3]) or 0
if job[2] == '1' then
  return release('job cancelled before the relay performed it', 'cancelled')
end
-- a completed job takes no new dispatch (as in admit-8): its queued or retried steps end
if redis.call('HEXISTS', KEYS[2], 'completed') == 1 then
  return release('the job completed before the relay performed it', 'job_completed',
    'job_completed', fmt(fence))
end
if gen < fence then
  return release('superseded by generation ' .. fmt(fence) .. ' before the relay sent it',
    'superseded', 'superseded', fmt(fence))
end
local lease_exp = tonumber(job[3]) or 0
if gen == fence and lease_exp > 0 and now >= lease_exp then
  return release('the lease of generation ' .. fmt(gen) .. ' ran out before the relay sent it',
    'lease_expired', 'lease_expired', fmt(fence))
end
if not fx[6] or fx[7] ~= fx[8] then
  return release('the stored payload does not belong to the pinned intent', 'unbound')
end

local deadline = now + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'state', 'dispatching', 'dispatch_id', ARGV[1],
  'deadline', fmt(deadline), 'updated_at', fmt(now), 'resolving', '0')
redis.call('HINCRBY', KEYS[1], 'attempts', 1)
redis.call('EXPIRE', KEYS[1], ARGV[3])
index(KEYS[5], member, 'dispatching', fmt(deadline))
-- stays queued until the outcome is recorded: a relay that dies is found again at the deadline
queue_add(KEYS[4], KEYS[6], member, deadline)
-- a re-send is answered without the payload (it stays in the effect hash while the claim
-- holds the step): a claim per attempt must not keep a copy of it for the request memory
return done({0, ARGV[1], fx[3], fx[4], fx[5], fx[6], fmt(deadline)},
  {0, ARGV[1], fx[3], fx[4], fx[5], '', fmt(deadline)})
