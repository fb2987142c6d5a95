--[[
  Cancel a job: every later call and registration is refused. Idempotent.

  Input:
    KEYS[1] job hash   fg:{t/j}:job
    KEYS[2] durability marker of this slot  fg:marker:{<slot tag>}

  Output:
    {0, fence}   cancelled now
    {1, fence}   was already cancelled
    {8}          the slot's durability marker is missing: nothing done
]]
if redis.call('EXISTS', KEYS[2]) == 0 then return {8} end
local job = redis.call('HMGET', KEYS[1], 'fence', 'cancelled')
local fence = job[1] or '0'
if job[2] == '1' then return {1, fence} end
redis.call('HSET', KEYS[1], 'cancelled', '1', 'cancelled_at', fmt(now_ms()))
return {0, fence}
