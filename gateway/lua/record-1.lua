--[[
  Record the outcome of a dispatch, only for the dispatch that holds the step.
  A dispatch that started under generation g is recorded even if g+1 was
  registered meanwhile: the effect happened.

  Input:
    KEYS[1] effect hash   fg:{t/j}:fx:<step>
    ARGV[1] dispatch id returned by admit-5
    ARGV[2] new state: 'succeeded' | 'failed' | 'unknown' | 'released'
    ARGV[3] result JSON ('' for none)
    ARGV[4] error JSON ('' for none)
    ARGV[5] retention, seconds

  Output:
    {0}          recorded
    {1, state}   lost: another dispatch holds the step, or it was resolved meanwhile
]]
local fx = redis.call('HMGET', KEYS[1], 'dispatch_id', 'state')
-- a retried record of this very outcome (reply lost on a reset connection)
if fx[1] == ARGV[1] and fx[2] == ARGV[2] then return {0} end
if fx[1] ~= ARGV[1] or (fx[2] ~= 'dispatching' and fx[2] ~= 'unknown') then
  return {1, fx[2] or ''}
end
local now = now_ms()
redis.call('HSET', KEYS[1], 'state', ARGV[2], 'updated_at', fmt(now), 'deadline', '0')
if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], 'result', ARGV[3]) end
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'error', ARGV[4]) end
redis.call('EXPIRE', KEYS[1], ARGV[5])
return {0}
