--[[
  Admit one effect call: the fence decision, the step's intent pin and the
  dispatch claim, in one atomic step. One round trip on the hot path.

  Input:
    KEYS[1] job hash          fg:{t/j}:job
    KEYS[2] effect hash       fg:{t/j}:fx:<step>
    KEYS[3] job audit stream  fg:{t/j}:audit
    KEYS[4] job steps set     fg:{t/j}:steps
    KEYS[5] durability marker of this slot  fg:marker:{<slot tag>}
    ARGV[1]  generation presented (decimal)
    ARGV[2]  registration mode: 'required' | 'implicit'
    ARGV[3]  intent sha256 (hex)
    ARGV[4]  adapter name
    ARGV[5]  operation
    ARGV[6]  dispatch id (random; proves ownership of the step to record-1)
    ARGV[7]  dispatch timeout, ms
    ARGV[8]  retention, seconds (effect records, steps set, audit stream)
    ARGV[9]  '1' when the adapter can resolve an unknown outcome (lookup or dedupes_by_key)
    ARGV[10] job id   ARGV[11] step   ARGV[12] worker id ('' if none)   ARGV[13] tenant
    ARGV[14] '' for a synchronous call; the payload JSON for an async call (Prefer:
             respond-async): the intent is recorded 'pending' for a relay to perform

  Output:
    {0, dispatch_id, fence, deadline_ms, resolving}  admitted: caller holds the step
                                                     (resolving = '1': the step was unknown)
    {1, field, value, ...}   replay: the recorded effect (succeeded | failed)
    {2, retry_after_ms}      another dispatch holds the step
    {3, field, value, ...}   outcome unknown and the adapter cannot resolve it
    {4}                      async: recorded 'pending' for the relay
    {5, field, value, ...}   the step is already pending or dispatching (async: accepted again)
    {8}   the slot's durability marker is missing: Redis lost data, nothing done
    {9, reason, presented, current, audit_id, pinned_sha}   rejected and audited
]]
if redis.call('EXISTS', KEYS[5]) == 0 then return {8} end
local gen = tonumber(ARGV[1])
local now = now_ms()
local job = redis.call('HMGET', KEYS[1], 'fence', 'cancelled', 'lease_exp')
local fence = tonumber(job[1]) or 0

local function reject(reason, pinned)
  local id = audit(KEYS[3], KEYS[1], ARGV[8], now, {
    'tenant', ARGV[13], 'job_id', ARGV[10], 'step', ARGV[11], 'reason', reason,
    'presented', ARGV[1], 'current', fmt(fence), 'worker_id', ARGV[12], 'adapter', ARGV[4]})
  return {9, reason, ARGV[1], fmt(fence), id, pinned or ''}
end

if job[2] == '1' then return reject('job_cancelled') end
if gen < fence then return reject('stale_generation') end
if gen > fence then
  if ARGV[2] ~= 'implicit' then return reject('unregistered_generation') end
  -- implicit mode: classic highest-seen fencing; a new generation has no lease
  redis.call('HSET', KEYS[1], 'fence', ARGV[1], 'lease_exp', '0')
  fence = gen
else
  local lease_exp = tonumber(job[3]) or 0
  if lease_exp > 0 and now >= lease_exp then return reject('lease_expired') end
end

local fx = redis.call('HMGET', KEYS[2], 'state', 'intent_sha256', 'deadline', 'dispatch_id')
local state = fx[1]

local function claim(resolving)
  local deadline = now + tonumber(ARGV[7])
  redis.call('HSET', KEYS[2], 'state', 'dispatching', 'intent_sha256', ARGV[3],
    'adapter', ARGV[4], 'operation', ARGV[5], 'dispatch_id', ARGV[6],
    'deadline', fmt(deadline), 'updated_at', fmt(now), 'worker_id', ARGV[12])
  if resolving == '0' then
    -- a fresh dispatch: this generation is the one that dispatches it
    redis.call('HSET', KEYS[2], 'generation', ARGV[1])
    redis.call('HDEL', KEYS[2], 'result', 'error')
  end
  redis.call('HINCRBY', KEYS[2], 'attempts', 1)
  redis.call('EXPIRE', KEYS[2], ARGV[8])
  redis.call('SADD', KEYS[4], ARGV[11])
  redis.call('EXPIRE', KEYS[4], ARGV[8])
  return {0, ARGV[6], fmt(fence), fmt(deadline), resolving}
end

local function enqueue()
  redis.call('HSET', KEYS[2], 'state', 'pending', 'intent_sha256', ARGV[3], 'adapter', ARGV[4],
    'operation', ARGV[5], 'payload', ARGV[14], 'generation', ARGV[1], 'updated_at', fmt(now),
    'worker_id', ARGV[12])
  redis.call('HDEL', KEYS[2], 'result', 'error', 'dispatch_id')
  redis.call('EXPIRE', KEYS[2], ARGV[8])
  redis.call('SADD', KEYS[4], ARGV[11])
  redis.call('EXPIRE', KEYS[4], ARGV[8])
  return {4}
end

if not state then
  redis.call('HSET', KEYS[2], 'created_at', fmt(now))
  if ARGV[14] ~= '' then return enqueue() end
  return claim('0')
end
-- released: known not delivered; the current generation may re-pin the step
if state == 'released' then
  if ARGV[14] ~= '' then return enqueue() end
  return claim('0')
end

if fx[2] ~= ARGV[3] then return reject('intent_mismatch', fx[2]) end

if state == 'pending' or (state == 'dispatching' and ARGV[14] ~= '') then
  -- the relay has it: an async repeat is accepted again, a sync call waits
  if ARGV[14] ~= '' then return {5, unpack(redis.call('HGETALL', KEYS[2]))} end
  return {2, '1000'}
end

if state == 'dispatching' then
  local deadline = tonumber(fx[3]) or 0
  -- a retried admit of this very dispatch (reply lost on a reset connection)
  if fx[4] == ARGV[6] then return {0, ARGV[6], fmt(fence), fmt(deadline), '0'} end
  if now < deadline then return {2, fmt(deadline - now)} end
  -- the holder died or stalled past its deadline: the outcome is not known
  redis.call('HSET', KEYS[2], 'state', 'unknown', 'updated_at', fmt(now),
    'error', '{"reason":"dispatch deadline passed without a recorded outcome"}')
  state = 'unknown'
end

if state == 'unknown' then
  if ARGV[9] == '1' then return claim('1') end
  return {3, unpack(redis.call('HGETALL', KEYS[2]))}
end

return {1, unpack(redis.call('HGETALL', KEYS[2]))}
