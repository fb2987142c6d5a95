--[[
  Repair one step's entry in its slot's "needs a decision" index from the step's record
  (the reconciler calls it for an entry that does not match its record: the record expired
  with its retention while the step was still unknown, or Redis lost part of a slot).

  Input (the prelude's trailer follows):
    KEYS[1] effect hash   fg:{t/j}:fx:<step>
    KEYS[2] "needs a decision" index of this slot  fg:nd:{<s>}
    ARGV[1] queue member (JSON [tenant, job, step])

  Output:
    {0, state}   repaired: the entry now follows the record ('' : no record, entry removed)
    {1, state}   it already did: nothing changed
]]
--- @include "includes/index"
local fx = redis.call('HMGET', KEYS[1], 'state', 'deadline', 'updated_at')
local state = fx[1] or ''
local score = redis.call('ZSCORE', KEYS[2], ARGV[1])
local want
if state == 'dispatching' then
  want = fx[2] or '0'
elseif state == 'unknown' then
  want = score or fx[3] or fmt(now_ms())
end
if want == nil and score == nil then return {1, state} end
if want ~= nil and score ~= nil and tonumber(want) == tonumber(score) then return {1, state} end
index(KEYS[2], ARGV[1], state, want)
return done({0, state})
