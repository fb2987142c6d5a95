--[[
  One consistent snapshot of a job's audit chain, read only (gateway.store.anchors: the
  anchorer). A plain script: no prelude, no trailer.

  Input:
    KEYS[1] job hash       fg:{t/j}:job
    KEYS[2] audit stream   fg:{t/j}:audit
    ARGV[1] the entry last seen here

  Output:
    {audit_head, audit_last, stream length, newest entry id, 1 if the seen entry is there}
]]
local h = redis.call('HMGET', KEYS[1], 'audit_head', 'audit_last')
local newest = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)[1]
local seen = redis.call('XRANGE', KEYS[2], ARGV[1], ARGV[1], 'COUNT', 1)[1]
return {h[1] or false, h[2] or false, redis.call('XLEN', KEYS[2]),
  newest and newest[1] or false, seen and 1 or 0}
