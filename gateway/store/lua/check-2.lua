--[[
  Check: may this generation act on the job now? The fence check of a proxied read (a GET or
  HEAD of an upstream whose reads are fenced), which pins, records and renews nothing.

  Input (the prelude's trailer follows):
    KEYS[1] job hash          fg:{t/j}:job
    KEYS[2] job audit stream  fg:{t/j}:audit
    ARGV[1..8] the fenced call (includes/fence): generation, mode, job id, tenant, worker id,
            retention, who calls ('': a check never raises the fence), the tenant's rejections
    ARGV[9]  step ('' if none)   ARGV[10] adapter: named in a rejection's audit entry

  The fence guard (includes/fence) with peek, in order: cancelled, stale, completed, then
  above the fence unregistered (mode 'required') or passed without the raise (mode
  'implicit': the generation raises the fence at its first fenced write, not at a read), at
  the fence the lease (expired: refused; never extended).

  Output:
    {0, fence, lease_exp_ms}                        may act ('0': no lease); nothing written
    {9, reason, presented, current, audit_id, ''}   rejected and audited
      (job_cancelled, stale_generation, job_completed, unregistered_generation,
       lease_expired)
]]
--- @include "includes/fence"
local call = fenced_call(ARGV, KEYS[1], KEYS[2], ARGV[9], ARGV[10], now_ms())
call.peek = true
local g = fence_guard(call, {'cancelled', 'stale', 'completed'})
if g.reply then return g.reply end
return {0, fmt(g.fence), fmt(g.lease_exp)}
