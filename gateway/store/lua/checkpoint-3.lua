--[[
  Write one checkpoint of a job under the fence: the same cancel, fence and lease
  rules as an effect's admit, and nothing after the job completed.

  Input (the prelude's trailer follows):
    KEYS[1] job hash          fg:{t/j}:job
    KEYS[2] checkpoints hash  fg:{t/j}:ckpt   (field <name> -> JSON, see below)
    KEYS[3] job audit stream  fg:{t/j}:audit
    ARGV[1] generation presented (decimal)
    ARGV[2] registration mode: 'required' | 'implicit'
    ARGV[3] checkpoint name
    ARGV[4] the value, canonical JSON (the gateway parsed and re-encoded it)
    ARGV[5] worker id as a JSON string, or 'null'
    ARGV[6] worker id as sent ('' if none, for the audit entry)
    ARGV[7] job id   ARGV[8] tenant   ARGV[9] retention, seconds
    ARGV[10] who calls (the key's name, else its role; '' when not given): recorded with an
             implicit registration (the fence raised in implicit mode: 'event' = 'registered')

  The stored field: {"generation":g,"value":<json>,"worker":<string|null>,"at_ms":ms},
  written as text here so the value's numbers are never re-encoded by Lua.

  Output:
    {0, fence, at_ms}   written
    {9, reason, presented, current, audit_id, ''}   rejected and audited
      (job_cancelled, stale_generation, unregistered_generation, lease_expired,
       job_completed)

  The fence guard (includes/fence), in order: cancelled, stale, completed, then above the
  fence unregistered (mode 'required') or the raise (mode 'implicit', no lease), at the fence
  the lease. The audit entry names the step 'checkpoint:<name>' (':' is never in a step name).
]]
--- @include "includes/fence"
local gen = tonumber(ARGV[1])
local now = now_ms()
-- a completed job keeps its state as it was when it completed, whoever asks
local g = fence_guard({job = KEYS[1], stream = KEYS[3], retention = ARGV[9], now = now,
  tenant = ARGV[8], job_id = ARGV[7], step = 'checkpoint:' .. ARGV[3], presented = ARGV[1],
  worker_id = ARGV[6], adapter = '', mode = ARGV[2], by = ARGV[10] or ''},
  {'cancelled', 'stale', 'completed'})
if g.reply then return g.reply end

redis.call('HSET', KEYS[2], ARGV[3], '{"generation":' .. fmt(gen) .. ',"value":' .. ARGV[4] ..
  ',"worker":' .. ARGV[5] .. ',"at_ms":' .. fmt(now) .. '}')
redis.call('EXPIRE', KEYS[2], ARGV[9])
return done({0, fmt(g.fence), fmt(now)})
