--[[
  Register a generation at takeover: externally allocated, or the next one.

  Input (the prelude's trailer follows):
    KEYS[1] job hash          fg:{t/j}:job
    KEYS[2] job audit stream  fg:{t/j}:audit
    ARGV[1] generation (decimal), or '' to allocate fence + 1
    ARGV[2] lease, ms ('' for no lease)
    ARGV[3] job id   ARGV[4] tenant   ARGV[5] retention, seconds
    ARGV[6] largest allowed generation (2^53 - 1)
    ARGV[7] who registers (the key's name, else its role)

  Output:
    {0, generation, lease_exp_ms, audit_id}   registered (lease_exp_ms '0' when no lease);
                                    recorded in the job's audit chain: 'event' = 'registered',
                                    'generation', 'previous' (the fence it replaced), 'by'
    {1, generation, lease_exp_ms}   that generation was already current (idempotent retry)
    {9, reason, presented, current, audit_id, ''}   rejected and audited
      (job_cancelled, job_completed, generation_exhausted, generation_regression)
]]
--- @include "includes/audit"
--- @include "includes/reject"
local now = now_ms()
local job = redis.call('HMGET', KEYS[1], 'fence', 'cancelled', 'lease_exp')
local fence = tonumber(job[1]) or 0
local presented = ARGV[1]

local call = {job = KEYS[1], stream = KEYS[2], retention = ARGV[5], now = now,
  tenant = ARGV[4], job_id = ARGV[3], step = '', presented = presented, worker_id = '',
  adapter = ''}
local function reject(reason) return reject_call(call, reason, fence) end

if job[2] == '1' then return reject('job_cancelled') end
-- a completed job is over: no generation, not even the current one again
if redis.call('HEXISTS', KEYS[1], 'completed') == 1 then return reject('job_completed') end

local gen
if presented == '' then
  gen = fence + 1
  if gen > tonumber(ARGV[6]) then return reject('generation_exhausted') end
else
  gen = tonumber(presented)
end

if gen < fence then return reject('generation_regression') end
if gen == fence then return {1, fmt(gen), job[3] or '0'} end

local lease_exp = '0'
if ARGV[2] ~= '' then lease_exp = fmt(now + tonumber(ARGV[2])) end
redis.call('HSET', KEYS[1], 'fence', fmt(gen), 'lease_ms', ARGV[2], 'lease_exp', lease_exp,
  'registered_at', fmt(now))
redis.call('PERSIST', KEYS[1])  -- a fence never expires
local id = audit(KEYS[2], KEYS[1], ARGV[5], now, {
  'tenant', ARGV[4], 'job_id', ARGV[3], 'event', 'registered', 'generation', fmt(gen),
  'previous', fmt(fence), 'by', ARGV[7], 'lease_ms', ARGV[2]})
return done({0, fmt(gen), lease_exp, id})
