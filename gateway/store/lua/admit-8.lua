--[[
  Admit one effect call: the fence decision, the step's intent pin and the
  dispatch claim (or, async, the relay queue entry), in one atomic step.

  Input (the prelude's trailer follows):
    KEYS[1] job hash          fg:{t/j}:job
    KEYS[2] effect hash       fg:{t/j}:fx:<step>
    KEYS[3] job audit stream  fg:{t/j}:audit
    KEYS[4] job steps set     fg:{t/j}:steps
    KEYS[5] relay queue of this slot  fg:rq:{<s>}   (member: ARGV[17])
    KEYS[6] "needs a decision" index of this slot  fg:nd:{<s>}   (member: ARGV[17])
    KEYS[7] the tenant's relay hints  fg:relay:t:<tenant>, KEYS[8] the tenants with hints
            fg:relay:tenants: on a standalone Redis only (includes/relayq); absent on a Cluster
    ARGV[1..8] the fenced call (includes/fence): generation, mode, job id, tenant,
             worker id, retention (effect records, steps set, audit stream), who calls,
             the tenant's rejections
    ARGV[9]  step
    ARGV[10] intent sha256 (hex)
    ARGV[11] adapter name
    ARGV[12] operation
    ARGV[13] dispatch id (= this call's request id; proves ownership of the step to record)
    ARGV[14] dispatch timeout, ms
    ARGV[15] '1' when the adapter can resolve an unknown outcome (lookup or dedupes_by_key)
    ARGV[16] '' for a synchronous call; the payload JSON for an async call (Prefer:
             respond-async): the intent is recorded 'pending' and queued for a relay
    ARGV[17] the relay queue member of this step (JSON [tenant, job, step])
    ARGV[18] run before, ms on Redis's clock ('' for no bound): arriving later, the admit does
             nothing ({11}); the gateway gives an admit up only after this, and its void
             marker lives until this at least (void-5)
    ARGV[19] the tenant's quotas that are used up (gateway.fencing.quotas), letters: 'e' no new
             dispatch or queue entry (effects_per_window), 'p' no new queue entry
             (payload_bytes; ARGV[16] is then a placeholder, never stored); '' none (a
             rejection answered but not audited is ARGV[8])
    ARGV[20] the tenant's held payloads fg:quota:{<tenant>}:held ([job, step] -> charge), or
             '' (a Cluster, where the tenant's keys are another slot: the gateway reserved the
             payload before this call, and ARGV[19] says whether it fitted)
    ARGV[21] their total fg:quota:{<tenant>}:held_bytes, ARGV[22] this step's member there
             ([job, step]), ARGV[23] this payload's charge, ARGV[24] the tenant's cap
             (payload_bytes, 0: none), ARGV[25] the counters' ttl, seconds. A call that would
             queue its payload is refused 'payload_bytes' when the charge does not fit (a
             charge the step holds already is replaced, so it does not count); queueing it
             charges it here, in the same atomic step
    ARGV[26] the tenant's effects counter of this window fg:quota:{<tenant>}:fx:<window>, or
             '' (a Cluster: ARGV[19]'s 'e' from the gateway's view), ARGV[27] its cap
             (effects_per_window), ARGV[28] its ttl, seconds. A call that would claim or
             queue the step is refused 'effects_per_window' at the cap; one that claims or
             queues it is counted here, in the same atomic step

  Output:
    {0, dispatch_id, fence, deadline_ms, resolving, superseded_audit_id, registered_audit_id}
                             admitted: the caller holds the step (resolving = '1': the step
                             was unknown and is looked up first)
    {1, field, value, ...}   replay: the recorded effect (succeeded | failed)
    {2, retry_after_ms, registered_audit_id}   another dispatch holds the step
    {3, field, value, ...}   outcome unknown and the adapter cannot resolve it
    {4, superseded_audit_id, registered_audit_id}
                             async: recorded 'pending' and queued for the relay
    {5, field, value, ...}   async repeat: the relay has the step already (pending or dispatching)
    {9, reason, presented, current, audit_id, pinned_sha}   rejected and audited
    {10}                     voided: the gateway gave this request up before it ran
    {11, now_ms}             too late: it arrived after ARGV[18]; nothing was done
    {12, quota, registered_audit_id}
                             the call would pin, queue or claim the step and that quota is
                             used up (ARGV[19]): nothing changed (but an implicit raise)

  A completed job (field 'completed' of the job hash, see complete-3.lua) takes no new
  dispatch from any generation: a call that would pin, queue or claim the step is
  rejected 'job_completed' (audited); a recorded outcome still replays, a step in flight
  still answers where it is. No generation is raised after a completion.

  A pending step queued by an older generation was never claimed, so nothing was
  sent: the current generation supersedes it (audited as 'superseded') and pins
  its own intent. The stored async payload always belongs to the pinned intent
  (payload_sha); a synchronous pin drops it and the queue entry.

  The fence guard (includes/fence): cancelled, stale; then above the fence a completed job
  is rejected, an unregistered generation too (mode 'required'), or the fence is raised
  (mode 'implicit'); at the fence, an expired lease is rejected.

  Implicit registration mode raises the fence to a higher generation presented: that is a
  registration, recorded in the job's audit chain ('event' = 'registered', by ARGV[7]);
  registered_audit_id names it ('' when nothing was registered; the replies carrying the
  effect record leave it out, the job's next audit entry anchors it).
  Every state change of the step updates the slot's "needs a decision" index (index()).
]]
--- @include "includes/index"
--- @include "includes/fence"
--- @include "includes/relayq"
local gen = tonumber(ARGV[1])
local now = now_ms()
-- sent too late to run (ARGV[18]): the gateway may have given it up, and its void marker
-- is only guaranteed to live until then; nothing is done, nothing remembered
local run_before = tonumber(ARGV[18] or '')
if run_before and now > run_before then return {11, fmt(now)} end
local member = ARGV[17]
local closed = ARGV[19] or ''
local call = fenced_call(ARGV, KEYS[1], KEYS[3], ARGV[9], ARGV[11], now)
local g = fence_guard(call, {'cancelled', 'stale'})
if g.reply then return g.reply end
local fence = g.fence
local raised = g.raised  -- implicit mode raised the fence: a read-only answer is a write too
local registered = g.registered  -- the audit entry of that registration
local reject = g.reject
local completed = g.completed

-- an answer that changed nothing, unless the fence was raised on the way
local function answer(reply)
  if raised then return done(reply) end
  return reply
end

-- the effect hash, read once: its fields below, and as it is in the replies that carry it
-- (unless this call changed it: effect_record())
local stored = redis.call('HGETALL', KEYS[2])
local h = {}
for i = 1, #stored, 2 do h[stored[i]] = stored[i + 1] end
local fx = {h.state, h.intent_sha256, h.deadline, h.dispatch_id, h.generation, h.relay,
  h.resolving, h.worker_id, h.adapter}
local state = fx[1]
local superseded = ''
local dirty = false  -- this call changed the step already (a dispatch past its deadline)

-- the quota a call that would pin (queues: async, with its payload) or claim the step runs
-- into, or nil. Checked before anything of the step is written: a refused call changes nothing.
local held, charge, cap = ARGV[20] or '', tonumber(ARGV[23] or '0'), tonumber(ARGV[24] or '0')
local effects, effects_cap = ARGV[26] or '', tonumber(ARGV[27] or '0')
local function over(queues)
  if string.find(closed, 'e', 1, true) then return 'effects_per_window' end
  if effects ~= '' and tonumber(redis.call('GET', effects) or '0') >= effects_cap then
    return 'effects_per_window'
  end
  if queues and string.find(closed, 'p', 1, true) then return 'payload_bytes' end
  if queues and held ~= '' and cap > 0 then
    local total = tonumber(redis.call('GET', ARGV[21]) or '0')
    local old = tonumber(redis.call('HGET', held, ARGV[22]) or '0')
    if total - old + charge > cap then return 'payload_bytes' end
  end
  return nil
end

-- a call that claims or queues the step spends one effect call of the window
local function count_effect()
  if effects ~= '' and redis.call('INCR', effects) == 1 then
    redis.call('EXPIRE', effects, ARGV[28])
  end
end

local function refuse(quota)
  if dirty then return done({12, quota, registered}) end
  return answer({12, quota, registered})
end

local function effect_record()
  if dirty then return redis.call('HGETALL', KEYS[2]) end
  return stored
end

local function touch()
  redis.call('EXPIRE', KEYS[2], ARGV[6])
  redis.call('SADD', KEYS[4], ARGV[9])
  redis.call('EXPIRE', KEYS[4], ARGV[6])
end

-- adds to names the fields of the effect hash present now, of those named (as read, or as
-- this call left them: a dispatch marked unknown on the way): what an HDEL has to name
local function present(names, ...)
  for _, name in ipairs({...}) do
    if h[name] then names[#names + 1] = name end
  end
  return names
end

-- the fields of the step's first write: created_at first when the step is new
local function created(fields)
  if state then return fields end
  return {'created_at', fmt(now), unpack(fields)}
end

local function claim(resolving)
  if completed() then return reject('job_completed') end
  local quota = over(false)
  if quota then return refuse(quota) end
  local deadline = now + tonumber(ARGV[14])
  -- one write of the step: attempts counted from the hash as read (this script is atomic)
  local fields = created({'state', 'dispatching', 'intent_sha256', ARGV[10],
    'adapter', ARGV[11], 'operation', ARGV[12], 'dispatch_id', ARGV[13],
    'deadline', fmt(deadline), 'updated_at', fmt(now), 'worker_id', ARGV[5],
    'resolving', resolving})
  local gone = {}
  if resolving == '0' then
    -- a fresh dispatch: this generation is the one that dispatches it
    fields[#fields + 1] = 'generation'
    fields[#fields + 1] = ARGV[1]
    present(gone, 'result', 'error')
  end
  fields[#fields + 1] = 'attempts'
  fields[#fields + 1] = fmt((tonumber(h.attempts) or 0) + 1)
  -- the claim's first write: a command Redis refuses when out of memory (a ZREM or HDEL
  -- first would be allowed and let every later write through: a dispatch Redis cannot record)
  redis.call('HSET', KEYS[2], unpack(fields))
  -- a synchronous dispatch owns the step now: no stored payload, no queue entry (only a relay
  -- step is queued)
  present(gone, 'payload', 'payload_sha', 'relay')
  if h.relay then queue_remove(KEYS[5], KEYS[7], member) end
  if #gone > 0 then redis.call('HDEL', KEYS[2], unpack(gone)) end
  index(KEYS[6], member, 'dispatching', fmt(deadline))
  touch()
  count_effect()
  return done({0, ARGV[13], fmt(fence), fmt(deadline), resolving, superseded, registered})
end

local function enqueue()
  if completed() then return reject('job_completed') end
  redis.call('HSET', KEYS[2], unpack(created({'state', 'pending', 'intent_sha256', ARGV[10],
    'adapter', ARGV[11], 'operation', ARGV[12], 'payload', ARGV[16], 'payload_sha', ARGV[10],
    'relay', '1', 'generation', ARGV[1], 'updated_at', fmt(now), 'worker_id', ARGV[5]})))
  local gone = present({}, 'result', 'error', 'dispatch_id', 'deadline', 'resolving')
  if #gone > 0 then redis.call('HDEL', KEYS[2], unpack(gone)) end
  queue_add(KEYS[5], KEYS[7], member, now)
  if KEYS[8] then redis.call('SADD', KEYS[8], ARGV[4]) end
  index(KEYS[6], member, 'pending')
  touch()
  if held ~= '' then  -- the step holds this payload's charge (over() saw it fit)
    local old = tonumber(redis.call('HGET', held, ARGV[22]) or '0')
    redis.call('HSET', held, ARGV[22], ARGV[23])
    if redis.call('INCRBY', ARGV[21], charge - old) <= 0 then redis.call('DEL', ARGV[21]) end
    redis.call('EXPIRE', held, ARGV[25])
    if redis.call('EXISTS', ARGV[21]) == 1 then redis.call('EXPIRE', ARGV[21], ARGV[25]) end
  end
  count_effect()
  return done({4, superseded, registered})
end

local function pin()
  if ARGV[16] ~= '' then return enqueue() end
  return claim('0')
end

if not state then
  if completed() then return reject('job_completed') end
  local quota = over(ARGV[16] ~= '')
  if quota then return refuse(quota) end
  return pin()  -- created_at: written with the pin (state is nil)
end
-- released: known not delivered; the current generation may re-pin the step
if state == 'released' then
  local quota = over(ARGV[16] ~= '')
  if quota then return refuse(quota) end
  return pin()
end

if state == 'pending' and (tonumber(fx[5]) or 0) < gen then
  if completed() then return reject('job_completed') end
  local quota = over(ARGV[16] ~= '')
  if quota then return refuse(quota) end
  -- queued by an older generation and never claimed: nothing was sent. Supersede it.
  local entry = {'step', ARGV[9], 'reason', 'superseded', 'presented', fx[5] or '',
    'current', fmt(fence), 'worker_id', fx[8] or '', 'adapter', fx[9] or ''}
  superseded = audit(KEYS[3], KEYS[1], ARGV[6], now,
    {'tenant', ARGV[4], 'job_id', ARGV[3], unpack(entry)}, g.known)
  feed_copy(call, superseded, entry)
  return pin()
end

if fx[2] ~= ARGV[10] then return reject('intent_mismatch', fx[2]) end

if state == 'pending' then
  -- the relay has it: an async repeat is accepted again, a sync call waits
  if ARGV[16] ~= '' then return answer({5, unpack(effect_record())}) end
  return answer({2, '1000', registered})
end

local marked = false
if state == 'dispatching' then
  local deadline = tonumber(fx[3]) or 0
  if now < deadline then
    -- the relay holds it: an async repeat of the same generation is accepted again; a
    -- newer generation's call (its dispatch may end released, then superseded) and a
    -- sync holder: wait
    if ARGV[16] ~= '' and fx[6] == '1' and tonumber(fx[5]) == gen then
      return answer({5, unpack(effect_record())})
    end
    return answer({2, fmt(deadline - now), registered})
  end
  -- the holder died or stalled past its deadline: the outcome is not known
  local lapsed = '{"reason":"dispatch deadline passed without a recorded outcome"}'
  redis.call('HSET', KEYS[2], 'state', 'unknown', 'updated_at', fmt(now), 'error', lapsed)
  redis.call('HDEL', KEYS[2], 'payload', 'payload_sha', 'relay')
  queue_remove(KEYS[5], KEYS[7], member)
  index(KEYS[6], member, 'unknown', fmt(now))
  state = 'unknown'
  h.state, h.updated_at, h.error = 'unknown', fmt(now), lapsed
  h.payload, h.payload_sha, h.relay = nil, nil, nil
  marked = true
  dirty = true
  g.wrote = true
end

if state == 'unknown' then
  if ARGV[15] == '1' then return claim('1') end
  local reply = {3, unpack(effect_record())}
  if marked then return done(reply) end
  return answer(reply)
end

return answer({1, unpack(effect_record())})
