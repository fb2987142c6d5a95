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

  The audit entry names the step 'checkpoint:<name>' (':' is never in a step name).
]]
local gen = tonumber(ARGV[1])
local now = now_ms()
local job = redis.call('HMGET', KEYS[1], 'fence', 'cancelled', 'lease_exp')
local fence = tonumber(job[1]) or 0

local function reject(reason)
  local id = audit(KEYS[3], KEYS[1], ARGV[9], now, {
    'tenant', ARGV[8], 'job_id', ARGV[7], 'step', 'checkpoint:' .. ARGV[3], 'reason', reason,
    'presented', ARGV[1], 'current', fmt(fence), 'worker_id', ARGV[6], 'adapter', ''})
  return done({9, reason, ARGV[1], fmt(fence), id, ''})
end

if job[2] == '1' then return reject('job_cancelled') end
if gen < fence then return reject('stale_generation') end
-- a completed job keeps its state as it was when it completed, whoever asks
if redis.call('HEXISTS', KEYS[1], 'completed') == 1 then return reject('job_completed') end
if gen > fence then
  if ARGV[2] ~= 'implicit' then return reject('unregistered_generation') end
  -- implicit mode: classic highest-seen fencing; a new generation has no lease
  redis.call('HSET', KEYS[1], 'fence', ARGV[1], 'lease_exp', '0')
  redis.call('PERSIST', KEYS[1])  -- a fence never expires
  audit(KEYS[3], KEYS[1], ARGV[9], now, {
    'tenant', ARGV[8], 'job_id', ARGV[7], 'event', 'registered', 'generation', ARGV[1],
    'previous', fmt(fence), 'by', ARGV[10] or '', 'mode', 'implicit', 'worker_id', ARGV[6]})
  fence = gen
else
  local lease_exp = tonumber(job[3]) or 0
  if lease_exp > 0 and now >= lease_exp then return reject('lease_expired') end
end

redis.call('HSET', KEYS[2], ARGV[3], '{"generation":' .. fmt(gen) .. ',"value":' .. ARGV[4] ..
  ',"worker":' .. ARGV[5] .. ',"at_ms":' .. fmt(now) .. '}')
redis.call('EXPIRE', KEYS[2], ARGV[9])
return done({0, fmt(fence), fmt(now)})
