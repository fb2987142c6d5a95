--[[
  Record a rejection decided outside Redis (a bad token signature): read the
  fence and write the audit entry in one step.

  Input (the prelude's trailer follows):
    KEYS[1] job hash          fg:{t/j}:job
    KEYS[2] job audit stream  fg:{t/j}:audit
    ARGV[1] reason (problem code)   ARGV[2] generation presented ('' if unreadable)
    ARGV[3] job id   ARGV[4] step ('' if none)   ARGV[5] worker id ('' if none)
    ARGV[6] adapter ('' if none)   ARGV[7] tenant   ARGV[8] retention, seconds
    ARGV[9] the tenant's rejections (includes/reject's past_rejection_cap): past the cap
            answered ({9, …} with audit_id ''), nothing written but the count

  Output:
    {9, reason, presented, current, audit_id, ''}
]]
--- @include "includes/reject"
local now = now_ms()
local fence = tonumber(redis.call('HGET', KEYS[1], 'fence') or '0')
if past_rejection_cap(ARGV[9]) then return {9, ARGV[1], ARGV[2], fmt(fence), '', ''} end
return reject_call({job = KEYS[1], stream = KEYS[2], retention = ARGV[8], now = now,
  tenant = ARGV[7], job_id = ARGV[3], step = ARGV[4], presented = ARGV[2],
  worker_id = ARGV[5], adapter = ARGV[6]}, ARGV[1], fence)
