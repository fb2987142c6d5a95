--[[
  Heartbeat: is this generation still current? If so, renew its lease.

  Input (the prelude's trailer follows):
    KEYS[1] job hash          fg:{t/j}:job
    KEYS[2] job audit stream  fg:{t/j}:audit
    ARGV[1..8] the fenced call (includes/fence): generation, mode, job id, tenant, worker id,
            retention, who calls, the tenant's rejections

  The fence guard (includes/fence), in order: cancelled, stale, completed, then above the
  fence unregistered (mode 'required') or the raise (mode 'implicit': the fence is the
  presented generation, with no lease), at the fence the lease.

  Output:
    {0, fence, lease_exp_ms, registered_audit_id}   current; lease extended by its lease_ms
                               ('0': no lease). Implicit mode raising the fence is a
                               registration, in the job's audit chain like register-2's
                               (registered_audit_id; '' when nothing was registered)
    {9, reason, presented, current, audit_id, ''}   rejected and audited
      (job_cancelled, stale_generation, job_completed, unregistered_generation,
       lease_expired)
]]
--- @include "includes/fence"
local now = now_ms()
-- a completed job needs no lease: the worker is told to stop, like a stale one
local call = fenced_call(ARGV, KEYS[1], KEYS[2], '', '', now)
call.lease_ms = true
local g = fence_guard(call, {'cancelled', 'stale', 'completed'})
if g.reply then return g.reply end
-- raised just now: a new generation has no lease until it registers one
if g.raised then return done({0, fmt(g.fence), '0', g.registered}) end
local lease_ms = g.lease_ms
if lease_ms then
  local lease_exp = now + lease_ms
  redis.call('HSET', KEYS[1], 'lease_exp', fmt(lease_exp))
  return done({0, fmt(g.fence), fmt(lease_exp)})
end
return {0, fmt(g.fence), fmt(g.lease_exp)}
