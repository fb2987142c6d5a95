--[[
  The relay claims a queued step: pending (or released, when it was queued async)
  -> dispatching, for exactly one relay.

  Input:
    KEYS[1] effect hash   fg:{t/j}:fx:<step>
    KEYS[2] job hash      fg:{t/j}:job
    KEYS[3] durability marker of this slot  fg:marker:{<slot tag>}
    ARGV[1] dispatch id (random)   ARGV[2] dispatch timeout, ms   ARGV[3] retention, seconds

  Output:
    {0, dispatch_id, generation, adapter, operation, payload, deadline_ms}   claimed
    {2, deadline_ms}   another relay (or call) is dispatching it: look again after the deadline
    {3, state}         nothing to do (done, released to a sync caller, gone): drop it from the queue
    {8}                the slot's durability marker is missing: nothing done
]]
if redis.call('EXISTS', KEYS[3]) == 0 then return {8} end
local now = now_ms()
local fx = redis.call('HMGET', KEYS[1], 'state', 'deadline', 'generation', 'adapter', 'operation', 'payload')
local state = fx[1]
if state == 'dispatching' then
  local deadline = tonumber(fx[2]) or 0
  if now < deadline then return {2, fmt(deadline)} end
  -- the dispatcher died or stalled past its deadline: the outcome is not known
  redis.call('HSET', KEYS[1], 'state', 'unknown', 'updated_at', fmt(now),
    'error', '{"reason":"dispatch deadline passed without a recorded outcome"}')
  return {3, 'unknown'}
end
-- pending, or released (known not delivered) and queued async (payload kept): retry it
local retry = state == 'released' and fx[6]
if state ~= 'pending' and not retry then return {3, state or ''} end
if redis.call('HGET', KEYS[2], 'cancelled') == '1' then
  redis.call('HSET', KEYS[1], 'state', 'released', 'updated_at', fmt(now),
    'error', '{"reason":"job cancelled before the relay performed it"}')
  return {3, 'cancelled'}
end
local deadline = now + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'state', 'dispatching', 'dispatch_id', ARGV[1],
  'deadline', fmt(deadline), 'updated_at', fmt(now))
redis.call('HINCRBY', KEYS[1], 'attempts', 1)
redis.call('EXPIRE', KEYS[1], ARGV[3])
return {0, ARGV[1], fx[3], fx[4], fx[5], fx[6], fmt(deadline)}
