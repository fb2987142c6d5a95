--[[
  Consistent snapshots of jobs' audit chains, read only (gateway.store.anchors: the
  anchorer). A plain script: no prelude, no trailer.

  Input, for each job i (1-based; one job on a Cluster, where each job is its own slot;
  a whole chunk of jobs in one call on a standalone Redis):
    KEYS[2i-1] job hash       fg:{t/j}:job
    KEYS[2i]   audit stream   fg:{t/j}:audit
    ARGV[i]    the entry last seen here

  Output, five values per job, in the order of the jobs:
    audit_head, audit_last, stream length, newest entry id, 1 if the seen entry is there
  Each job's five are read in one step (the script is atomic): one consistent snapshot of
  that chain.
]]
local out = {}
for i = 1, #ARGV do
  local job, audit = KEYS[2 * i - 1], KEYS[2 * i]
  local h = redis.call('HMGET', job, 'audit_head', 'audit_last')
  local newest = redis.call('XREVRANGE', audit, '+', '-', 'COUNT', 1)[1]
  local seen = redis.call('XRANGE', audit, ARGV[i], ARGV[i], 'COUNT', 1)[1]
  local n = #out
  out[n + 1] = h[1] or false
  out[n + 2] = h[2] or false
  out[n + 3] = redis.call('XLEN', audit)
  out[n + 4] = newest and newest[1] or false
  out[n + 5] = seen and 1 or 0
end
return out
