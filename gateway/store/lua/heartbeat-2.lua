--[[
  Heartbeat: is this generation still current? If so, renew its lease.

  Input (the prelude's trailer follows):
    KEYS[1] job hash          fg:{t/j}:job
    KEYS[2] job audit stream  fg:{t/j}:audit
    ARGV[1] generation presented (decimal)
    ARGV[2] registration mode: 'required' | 'implicit'
    ARGV[3] job id   ARGV[4] worker id ('' if none)   ARGV[5] tenant
    ARGV[6] retention, seconds
    ARGV[7] who calls (the key's name, else its role): recorded with an implicit registration

  Output:
    {0, fence, lease_exp_ms, registered_audit_id}   current; lease extended by its lease_ms
                               ('0': no lease). Implicit mode raising the fence is a
                               registration, in the job's audit chain like register-2's
                               (registered_audit_id; '' when nothing was registered)
    {9, reason, presented, current, audit_id, ''}   rejected and audited
      (job_cancelled, stale_generation, job_completed, unregistered_generation,
       lease_expired)
]]
local gen = tonumber(ARGV[1])
local now = now_ms()
local job = redis.call('HMGET', KEYS[1], 'fence', 'cancelled', 'lease_exp', 'lease_ms')
local fence = tonumber(job[1]) or 0

local function reject(reason)
  local id = audit(KEYS[2], KEYS[1], ARGV[6], now, {
    'tenant', ARGV[5], 'job_id', ARGV[3], 'step', '', 'reason', reason,
    'presented', ARGV[1], 'current', fmt(fence), 'worker_id', ARGV[4], 'adapter', ''})
  return done({9, reason, ARGV[1], fmt(fence), id, ''})
end

if job[2] == '1' then return reject('job_cancelled') end
if gen < fence then return reject('stale_generation') end
-- a completed job needs no lease: the worker is told to stop, like a stale one
if redis.call('HEXISTS', KEYS[1], 'completed') == 1 then return reject('job_completed') end
if gen > fence then
  if ARGV[2] ~= 'implicit' then return reject('unregistered_generation') end
  redis.call('HSET', KEYS[1], 'fence', ARGV[1], 'lease_exp', '0', 'lease_ms', '')
  redis.call('PERSIST', KEYS[1])  -- a fence never expires
  local id = audit(KEYS[2], KEYS[1], ARGV[6], now, {
    'tenant', ARGV[5], 'job_id', ARGV[3], 'event', 'registered', 'generation', ARGV[1],
    'previous', fmt(fence), 'by', ARGV[7], 'mode', 'implicit', 'worker_id', ARGV[4]})
  return done({0, ARGV[1], '0', id})
end
local lease_exp = tonumber(job[3]) or 0
if lease_exp > 0 and now >= lease_exp then return reject('lease_expired') end
local lease_ms = tonumber(job[4] or '')
if lease_ms then
  lease_exp = now + lease_ms
  redis.call('HSET', KEYS[1], 'lease_exp', fmt(lease_exp))
  return done({0, fmt(fence), fmt(lease_exp)})
end
return {0, fmt(fence), fmt(lease_exp)}
