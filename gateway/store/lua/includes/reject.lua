--- @include "includes/audit"
--- @include "includes/feed"
--[[
  An audited rejection: the entry in the job's audit chain, its copy to the tenant feed
  (includes/feed) and the reply every script gives a call it rejects.

    reject_call(call, reason, current, pinned)
      -> done({9, reason, presented, current, audit_id, pinned or ''})

  call: the call's identity, built once by the script (every field a string, '' for none):
    job        job hash key              stream     job audit stream key (the job's slot)
    retention  seconds (the audit stream's)
    now        ms, Redis TIME (a number)
    tenant  job_id  step  presented (the generation as sent)  worker_id  adapter
    known      optional: what the script read of the job hash (see audit() in the prelude)
  current: the job's fence (a number). pinned: the step's pinned intent (intent_mismatch).
  The entry's fields, in this order (the chain hashes them in order): tenant, job_id, step,
  reason, presented, current, worker_id, adapter.
]]
--[[
  The tenant's audited rejections, counted (quotas.rejections_per_window):

    past_rejection_cap(flag) -> true when this rejection is answered, not audited

  flag: the fenced call's "rejections" argument (ARGV[8] of a fenced script, ARGV[9] of
  reject-2): '1' the gateway knows the tenant's rejections are used up; '' nothing is
  counted here (no cap, or a Cluster, where the counter is in another slot and the gateway
  counts after the script); '<cap> <ttl> <key>' (a standalone Redis) the window's counter,
  counted here: INCR (its TTL set when it is created), and past <cap> the rejection is
  answered, not audited. Counted at most once per request: an audited rejection is
  remembered (done()), and one past the cap stays past it when re-sent.
]]
local function past_rejection_cap(flag)
  if flag == '1' then return true end
  if flag == nil or #flag < 2 then return false end
  local cap, ttl, key = string.match(flag, '^(%d+) (%d+) (.+)$')
  local n = redis.call('INCR', key)
  if n == 1 then redis.call('EXPIRE', key, ttl) end
  return n > tonumber(cap)
end

local function reject_call(call, reason, current, pinned)
  local id = audit(call.stream, call.job, call.retention, call.now, {
    'tenant', call.tenant, 'job_id', call.job_id, 'step', call.step, 'reason', reason,
    'presented', call.presented, 'current', fmt(current), 'worker_id', call.worker_id,
    'adapter', call.adapter}, call.known)
  feed_copy(call, id, {'step', call.step, 'reason', reason, 'presented', call.presented,
    'current', fmt(current), 'worker_id', call.worker_id, 'adapter', call.adapter})
  return done({9, reason, call.presented, fmt(current), id, pinned or ''})
end
