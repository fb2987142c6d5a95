--[[
  Record the outcome of a dispatch, only for the dispatch that holds the step.
  A dispatch that started under generation g is recorded even if g+1 was
  registered meanwhile: the effect happened.

  Input (the prelude's trailer follows):
    KEYS[1] effect hash   fg:{t/j}:fx:<step>
    KEYS[2] relay queue of this slot  fg:rq:{<s>}
    KEYS[3] "needs a decision" index of this slot  fg:nd:{<s>}
    KEYS[4] the tenant's relay hints  fg:relay:t:<tenant>: on a standalone Redis only
            (includes/relayq); absent on a Cluster
    ARGV[1] dispatch id returned by admit or the relay's claim
    ARGV[2] new state: 'succeeded' | 'failed' | 'unknown' | 'released'
    ARGV[3] result JSON ('' for none)
    ARGV[4] error JSON ('' for none)
    ARGV[5] retention, seconds
    ARGV[6] queue member (JSON [tenant, job, step])
    ARGV[7] when a relay dispatch that ended 'released' is due again, ms

  Output:
    {0, due_ms}  recorded; due_ms is the relay's next attempt ('' when none)
    {1, state}   lost: another dispatch holds the step, or it was resolved meanwhile

  An outcome drops the stored payload and the queue entry, except a relay dispatch
  that ended 'released' (known not delivered): it stays queued for another attempt,
  which re-checks the fence when it claims. The step leaves the slot's "needs a decision"
  index, or (unknown) stays in it, scored from now.
]]
--- @include "includes/index"
--- @include "includes/relayq"
local fx = redis.call('HMGET', KEYS[1], 'dispatch_id', 'state', 'relay', 'result', 'error',
  'payload', 'payload_sha')
if fx[1] ~= ARGV[1] or (fx[2] ~= 'dispatching' and fx[2] ~= 'unknown') then
  return {1, fx[2] or ''}
end
local now = now_ms()
local state = ARGV[2]
-- one write of the outcome, one delete of what it leaves behind (fields present as read)
local fields = {'state', state, 'updated_at', fmt(now), 'deadline', '0'}
if ARGV[3] ~= '' then fields[#fields + 1] = 'result'; fields[#fields + 1] = ARGV[3] end
if ARGV[4] ~= '' then fields[#fields + 1] = 'error'; fields[#fields + 1] = ARGV[4] end
redis.call('HSET', KEYS[1], unpack(fields))
index(KEYS[3], ARGV[6], state, fmt(now))
local gone = {}
-- an outcome is the whole story: no error left over from an earlier attempt
if state == 'succeeded' and (fx[5] or ARGV[4] ~= '') then gone[#gone + 1] = 'error' end
if state == 'failed' and (fx[4] or ARGV[3] ~= '') then gone[#gone + 1] = 'result' end
local due = ''
local requeued = state == 'released' and fx[3] == '1'
if not requeued then
  if fx[6] then gone[#gone + 1] = 'payload' end
  if fx[7] then gone[#gone + 1] = 'payload_sha' end
  if fx[3] then gone[#gone + 1] = 'relay' end
end
if #gone > 0 then redis.call('HDEL', KEYS[1], unpack(gone)) end
redis.call('EXPIRE', KEYS[1], ARGV[5])
if requeued then
  due = ARGV[7]
  queue_add(KEYS[2], KEYS[4], ARGV[6], due)
elseif fx[3] == '1' then  -- a relay step (only those are queued: a sync claim unqueues)
  queue_remove(KEYS[2], KEYS[4], ARGV[6])
end
return done({0, due})
