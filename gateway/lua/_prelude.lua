--[[
  Prelude prepended to every fencegate script by gateway.store at load time.

  Result codes shared by all scripts (first element of the reply):
    0 OK / ADMITTED / CREATED
    1 REPLAY / ALREADY CURRENT / LOST (script-specific, see each header)
    2 IN_PROGRESS
    3 UNKNOWN
    8 DATA LOST: {8}, the durability marker of this slot is missing (fail closed)
    9 REJECTED: {9, reason, presented, current, audit_id, pinned_sha}
  Numbers cross the boundary as decimal strings: Lua numbers are doubles, exact
  up to 2^53, and tostring() would print large ones in exponent form.
]]
redis.replicate_commands()

-- Milliseconds from the Redis clock: one clock for every gateway instance.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function fmt(n)
  return string.format('%.0f', n)
end

-- Append an entry to the job's audit stream (same slot as the decision), chained:
-- each entry carries the hash of the previous one ('prev') and its own ('hash' =
-- sha1 over "name=value" lines of every field before it). The chain head lives in
-- the job hash. fields: flat list of name, value pairs. Returns the entry id.
local function audit(stream, job, retention, now, fields)
  local all = {'at', fmt(now)}
  for i = 1, #fields do all[#all + 1] = fields[i] end
  all[#all + 1] = 'prev'
  all[#all + 1] = redis.call('HGET', job, 'audit_head') or ''
  local lines = {}
  for i = 1, #all, 2 do lines[#lines + 1] = all[i] .. '=' .. all[i + 1] end
  local hash = redis.sha1hex(table.concat(lines, '\n'))
  all[#all + 1] = 'hash'
  all[#all + 1] = hash
  local id = redis.call('XADD', stream, '*', unpack(all))
  redis.call('HSET', job, 'audit_head', hash)
  redis.call('EXPIRE', stream, retention)
  return id
end
