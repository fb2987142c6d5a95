--[[
  Write one checkpoint of a job under the fence: the same cancel, fence and lease
  rules as an effect's admit, and nothing after the job completed.

  Input (the prelude's trailer follows):
    KEYS[1] job hash          fg:{t/j}:job
    KEYS[2] checkpoints hash  fg:{t/j}:ckpt   (field <name> -> JSON, see below)
    KEYS[3] job audit stream  fg:{t/j}:audit
    ARGV[1..8] the fenced call (includes/fence): generation, mode, job id, tenant, worker id
            (as sent, '' if none, for the audit entry), retention, who calls, the tenant's
            rejections
    ARGV[9]  checkpoint name
    ARGV[10] the value, canonical JSON (the gateway parsed and re-encoded it)
    ARGV[11] worker id as a JSON string, or 'null'
    ARGV[12] the most checkpoint names a job holds (checkpoints.max_per_job): a new name past
             it is refused; a replacement of a stored name never is
    ARGV[13] '1': the tenant's checkpoint bytes are used up (gateway.fencing.quotas): only a
             write that does not grow what the job stores is taken; '' otherwise
    ARGV[14] the fixed charge of one checkpoint on top of its stored bytes (quotas)

  The stored field: {"generation":g,"value":<json>,"worker":<string|null>,"at_ms":ms},
  written as text here so the value's numbers are never re-encoded by Lua. Its charge (the
  tenant's checkpoint_bytes quota): the field's bytes + the name's + ARGV[14].

  Output:
    {0, fence, at_ms, charge_replaced, charge}   written (charge_replaced: the charge of
                        the checkpoint of that name it replaced, '0' when the name is new)
    {12, quota}   refused, nothing of the checkpoint written: 'checkpoints_per_job' (a new
                  name past ARGV[12]) or 'checkpoint_bytes' (ARGV[13] and it grows)
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
local call = fenced_call(ARGV, KEYS[1], KEYS[3], 'checkpoint:' .. ARGV[9], '', now)
local g = fence_guard(call, {'cancelled', 'stale', 'completed'})
if g.reply then return g.reply end

local name = ARGV[9]
local overhead = tonumber(ARGV[14])
local text = '{"generation":' .. fmt(gen) .. ',"value":' .. ARGV[10] .. ',"worker":' ..
  ARGV[11] .. ',"at_ms":' .. fmt(now) .. '}'
local charge = #text + #name + overhead
local before = redis.call('HSTRLEN', KEYS[2], name)
local replaced = 0
if before > 0 then replaced = before + #name + overhead end

-- refused: nothing of the checkpoint is written (an implicit raise on the way stays)
local function refuse(quota)
  local reply = {12, quota}
  if g.raised then return done(reply) end
  return reply
end
local most = tonumber(ARGV[12])
if before == 0 and most > 0 and redis.call('HLEN', KEYS[2]) >= most then
  return refuse('checkpoints_per_job')
end
if ARGV[13] == '1' and charge > replaced then return refuse('checkpoint_bytes') end

redis.call('HSET', KEYS[2], name, text)
redis.call('EXPIRE', KEYS[2], ARGV[6])
return done({0, fmt(g.fence), fmt(now), fmt(replaced), fmt(charge)})
