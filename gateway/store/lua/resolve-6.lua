--[[
  Operator resolution of a step whose outcome is unknown (or still dispatching
  past its deadline): record what the operator established, audited.

  Input (the prelude's trailer follows):
    KEYS[1] effect hash       fg:{t/j}:fx:<step>
    KEYS[2] job hash          fg:{t/j}:job
    KEYS[3] job audit stream  fg:{t/j}:audit
    KEYS[4] relay queue of this slot  fg:rq:{<s>}
    KEYS[5] "needs a decision" index of this slot  fg:nd:{<s>}   (member: ARGV[8])
    KEYS[6] the tenant's relay hints  fg:relay:t:<tenant>: on a standalone Redis only
            (includes/relayq); absent on a Cluster
    ARGV[1] outcome: 'delivered' | 'not_delivered'
    ARGV[2] result JSON ('' for none)
    ARGV[3] job id   ARGV[4] step   ARGV[5] tenant   ARGV[6] retention, seconds
    ARGV[7] who resolved it, as 'operator:<role>' (recorded as worker_id in the audit entry)
    ARGV[8] queue member (JSON [tenant, job, step])
    ARGV[9] who resolved it: the key's name, else its role ('by' of the record and the entry)

  Output:
    {0, new_state, audit_id}   resolved: 'succeeded' or 'released'
    {1}                        no such effect
    {2, state}                 the step's outcome is known (or it is still in flight): not changed

  A resolved step leaves the slot's "needs a decision" index.
]]
--- @include "includes/audit"
--- @include "includes/index"
--- @include "includes/relayq"
local now = now_ms()
local fx = redis.call('HMGET', KEYS[1], 'state', 'deadline', 'generation', 'adapter')
local state = fx[1]
if not state then return {1} end
local overdue = state == 'dispatching' and now >= (tonumber(fx[2]) or 0)
if state ~= 'unknown' and not overdue then return {2, state} end
local new_state = 'released'
if ARGV[1] == 'delivered' then new_state = 'succeeded' end
redis.call('HSET', KEYS[1], 'state', new_state, 'updated_at', fmt(now), 'deadline', '0',
  'dispatch_id', '', 'resolved_by', ARGV[9])
index(KEYS[5], ARGV[8], new_state)
if ARGV[2] ~= '' then redis.call('HSET', KEYS[1], 'result', ARGV[2]) end
-- resolved: the relay never performs it again; the next call re-pins a released step
redis.call('HDEL', KEYS[1], 'error', 'payload', 'payload_sha', 'relay')
queue_remove(KEYS[4], KEYS[6], ARGV[8])
redis.call('EXPIRE', KEYS[1], ARGV[6])
local fence = redis.call('HGET', KEYS[2], 'fence') or '0'
local id = audit(KEYS[3], KEYS[2], ARGV[6], now, {
  'tenant', ARGV[5], 'job_id', ARGV[3], 'step', ARGV[4], 'reason', 'operator_resolved_' .. ARGV[1],
  'presented', fx[3] or '', 'current', fence, 'worker_id', ARGV[7], 'adapter', fx[4] or '',
  'by', ARGV[9]})
return done({0, new_state, id})
