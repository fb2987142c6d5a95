--- @include "includes/reject"
--[[
  The fence guard of every fenced call (admit-8, checkpoint-3, complete-3, output-stage-3,
  output-record-3, heartbeat-2, check-2): the same checks, the same implicit raise, the same
  audited rejection.

    local g = fence_guard(call, order, on_completed)
    if g.reply then return g.reply end

  call: the call's identity (fenced_call; see includes/reject), plus
    lease_ms  true: the script needs the job's lease_ms (g.lease_ms; heartbeat-2)
    leaseless  true: the lease is not checked (output-record-3: its stage checked it, and a
          lease that ran out without a new generation leaves the fence where it was)
    mode  'required' | 'implicit' (fencing.registration)
    by    who calls (the key's name, else its role): recorded with an implicit raise
    rejections  the tenant's rejections flag (ARGV[8]; includes/reject's
          past_rejection_cap): past the cap, a rejection is answered ({9, ..., audit_id
          ''}) but not audited
    peek  true: a check that writes nothing but its rejections (check-2): in mode 'implicit'
          a generation above the fence passes without the raise
  order: the checks made first, in the order the script documents, from
    'cancelled'  the job was cancelled                         -> job_cancelled
    'stale'      the generation presented is below the fence   -> stale_generation
    'completed'  the job completed (any generation)            -> on_completed() when it
                 gives a reply (complete-3's replay), else job_completed
  Every fenced script lists 'cancelled' and 'stale'; only 'completed' moves or is left out
  (admit-8 answers a completed job's replays and checks completion where it would dispatch).
  Then, always:
    presented above the fence:
      the job completed                      -> job_completed (a completed job's fence is
                                                never raised)
      mode 'required'                        -> unregistered_generation
      mode 'implicit', peek                  -> passes; nothing written (g.fence unchanged)
      mode 'implicit': the raise. The fence becomes the presented generation, with no
        lease: lease_exp '0' and lease_ms '' (the previous generation's lease is not
        inherited; only register-2 grants a lease). The job hash never expires (PERSIST).
        The raise is a registration in the job's audit chain: 'event' = 'registered',
        generation, previous, by, 'mode' = 'implicit', worker_id.
    presented equal to the fence: its lease ran out (lease_exp > 0 and Redis TIME at or
      past it; not checked when leaseless)   -> lease_expired

  g.reply       nil when the call passed; else the answer (a rejection, through done())
  g.fence       the fence after the guard (a number; the presented generation when raised)
  g.raised      the guard raised the fence: every answer of the script is a write (done())
  g.registered  the audit id of that registration ('' when none)
  g.lease_exp   the job's lease_exp (ms; 0: no lease, or raised just now)
  g.lease_ms    the job's lease_ms (a number; nil: none), read when call.lease_ms is true
  g.known       what audit() knows of the job hash from the guard's read (call.known is the
                same table: includes/audit)
  g.completed() whether the job completed: read with the guard's HMGET when `order` checks
                it, else with HEXISTS when first asked (the script has not written it yet)
  g.reject(reason, pinned)   an audited rejection of this call, later in the script
  g.wrote       set by a script that wrote before a later g.reject (admit-8 marking a lapsed
                dispatch unknown): a rejection past the cap, audited or not, is then a write
                too (done(): remembered for a re-send, the slot's counter raised)
]]
--[[
  The leading arguments of every fenced script, in this order (the store builds them once,
  gateway.store.scripts.fenced_args); the script's own arguments follow from ARGV[9]:

    ARGV[1] generation presented (decimal)
    ARGV[2] registration mode: 'required' | 'implicit'
    ARGV[3] job id   ARGV[4] tenant   ARGV[5] worker id ('' if none)
    ARGV[6] retention, seconds (the audit stream, and what the script stores)
    ARGV[7] who calls (the key's name, else its role; '' when not given): recorded with an
            implicit registration
    ARGV[8] the tenant's rejections (quotas.rejections_per_window; past_rejection_cap in
            includes/reject): '1' used up: a rejection is answered ({9, ...} with audit_id
            ''), not audited; '' not counted here; '<cap> <ttl> <key>' counted here, each
            rejection, and past <cap> answered, not audited

    local call = fenced_call(ARGV, KEYS[1], stream, step, adapter, now)

  The call's identity (includes/reject) from them: `job` the job hash key (KEYS[1] in every
  fenced script), `stream` its audit stream key, `now` Redis TIME in ms (a number).
]]
local function fenced_call(args, job, stream, step, adapter, now)
  return {job = job, stream = stream, retention = args[6], now = now, tenant = args[4],
    job_id = args[3], step = step, presented = args[1], worker_id = args[5],
    adapter = adapter, mode = args[2], by = args[7], rejections = args[8]}
end

local function fence_guard(call, order, on_completed)
  -- the job hash, read once, with what the checks in `order` and the script need of it
  -- (each field read costs a replay too: the rest is read when asked)
  local asks = call.lease_ms == true  -- completion read with the rest (and lease_ms)
  for i = 1, #order do asks = asks or order[i] == 'completed' end
  local job
  if asks and call.lease_ms then
    job = redis.call('HMGET', call.job, 'fence', 'cancelled', 'lease_exp', 'completed',
      'lease_ms')
  elseif asks then
    job = redis.call('HMGET', call.job, 'fence', 'cancelled', 'lease_exp', 'completed')
  else
    job = redis.call('HMGET', call.job, 'fence', 'cancelled', 'lease_exp')
  end
  local gen = tonumber(call.presented)
  local g = {fence = tonumber(job[1]) or 0, raised = false, wrote = false, registered = '',
    lease_exp = tonumber(job[3]) or 0, lease_ms = tonumber(asks and job[5] or ''),
    known = {lasting = job[1] ~= false or job[2] ~= false}}
  call.known = g.known  -- the audit entries of this call chain from it (includes/audit)
  local completed = nil  -- not read yet
  if asks then completed = job[4] end
  function g.completed()
    if completed == nil then
      completed = redis.call('HEXISTS', call.job, 'completed') == 1 and '1' or false
    end
    return completed ~= false
  end
  function g.reject(reason, pinned)
    if past_rejection_cap(call.rejections) then  -- answered, not audited
      local reply = {9, reason, call.presented, fmt(g.fence), '', pinned or ''}
      if g.raised or g.wrote then return done(reply) end
      return reply
    end
    return reject_call(call, reason, g.fence, pinned)
  end

  local checks = {
    cancelled = function()
      if job[2] == '1' then return g.reject('job_cancelled') end
    end,
    stale = function()
      if gen < g.fence then return g.reject('stale_generation') end
    end,
    completed = function()
      if not g.completed() then return nil end
      return (on_completed and on_completed()) or g.reject('job_completed')
    end,
  }
  for i = 1, #order do
    local check = checks[order[i]] or error('fence_guard: no check named ' .. order[i])
    g.reply = check()
    if g.reply then return g end
  end

  if gen > g.fence then
    if g.completed() then
      g.reply = g.reject('job_completed')
    elseif call.mode ~= 'implicit' then
      g.reply = g.reject('unregistered_generation')
    elseif not call.peek then
      redis.call('HSET', call.job, 'fence', call.presented, 'lease_exp', '0', 'lease_ms', '')
      redis.call('PERSIST', call.job)  -- a fence never expires
      g.known.lasting = true
      g.registered = audit(call.stream, call.job, call.retention, call.now, {
        'tenant', call.tenant, 'job_id', call.job_id, 'event', 'registered',
        'generation', call.presented, 'previous', fmt(g.fence), 'by', call.by,
        'mode', 'implicit', 'worker_id', call.worker_id}, g.known)
      g.fence = gen
      g.raised = true
      g.lease_exp = 0
    end
  elseif not call.leaseless and g.lease_exp > 0 and call.now >= g.lease_exp then
    g.reply = g.reject('lease_expired')
  end
  return g
end
