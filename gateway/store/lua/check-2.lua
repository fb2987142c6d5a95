--[[
  Check: may this generation act on the job now? The fence check of a proxied read (a GET or
  HEAD of an upstream whose reads are fenced), which pins, records and renews nothing.

  Input (the prelude's trailer follows):
    KEYS[1] job hash          fg:{t/j}:job
    KEYS[2] job audit stream  fg:{t/j}:audit
    ARGV[1] generation presented (decimal)
    ARGV[2] registration mode: 'required' | 'implicit'
    ARGV[3] job id   ARGV[4] worker id ('' if none)   ARGV[5] tenant
    ARGV[6] retention, seconds
    ARGV[7] step ('' if none)   ARGV[8] adapter: named in a rejection's audit entry
    ARGV[9] '1': the tenant's audited rejections are used up (quotas.rejections_per_window):
            a rejection is answered ({9, …} with audit_id ''), not audited

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
local g = fence_guard({job = KEYS[1], stream = KEYS[2], retention = ARGV[6], now = now_ms(),
  tenant = ARGV[5], job_id = ARGV[3], step = ARGV[7], presented = ARGV[1], worker_id = ARGV[4],
  adapter = ARGV[8], mode = ARGV[2], by = '', peek = true, unaudited = ARGV[9] == '1'},
  {'cancelled', 'stale', 'completed'})
if g.reply then return g.reply end
return {0, fmt(g.fence), fmt(g.lease_exp)}
