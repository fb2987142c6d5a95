--[[
  The copy of a job's audit entry to the tenant-wide feed (FEED, the prelude's trailer:
  fg:audit:<tenant>), in the script that wrote the entry: atomic with it and remembered with
  its reply, so a re-sent call copies nothing twice. FEED '' (a Cluster: the feed lives in
  another slot): nothing here; the store copies the entry after the script.

    feed_copy(call, audit_id, fields)

  call: the call's identity (includes/reject: tenant, job_id, now, retention). fields: the
  entry's name, value pairs the feed lists (step, reason, presented, current, worker_id,
  adapter, as gateway.store.base writes them), after 'at' (the entry id's ms), 'tenant',
  'job_id' and 'job_audit_id'. The feed is trimmed by age: MINID ~ now - retention.
  Best effort, as the store's copy: a copy that fails does not undo the decision.
]]
local function feed_copy(call, audit_id, fields)
  if FEED == '' or audit_id == '' then return end
  local min_id = fmt(call.now - tonumber(call.retention) * 1000) .. '-0'
  redis.pcall('XADD', FEED, 'MINID', '~', min_id, '*', 'at', string.match(audit_id, '^%d+'),
    'tenant', call.tenant, 'job_id', call.job_id, 'job_audit_id', audit_id, unpack(fields))
end
