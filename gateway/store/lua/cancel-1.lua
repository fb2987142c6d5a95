--[[
  Cancel a job: every later call and registration is refused. Idempotent.

  Input (the prelude's trailer follows):
    KEYS[1] job hash   fg:{t/j}:job

  Output:
    {0, fence}   cancelled now
    {1, fence}   was already cancelled
    {2, fence}   the job completed: its result stands and is not cancelled (its promoted
                 outputs must never be swept as a cancelled job's)
]]
local job = redis.call('HMGET', KEYS[1], 'fence', 'cancelled')
local fence = job[1] or '0'
if job[2] == '1' then return {1, fence} end
if redis.call('HEXISTS', KEYS[1], 'completed') == 1 then return {2, fence} end
redis.call('HSET', KEYS[1], 'cancelled', '1', 'cancelled_at', fmt(now_ms()))
redis.call('PERSIST', KEYS[1])  -- a cancellation never expires
return done({0, fence})
