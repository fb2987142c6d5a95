--[[
  The job's audit chain: audit(stream, job, retention, now, fields, known) appends one entry
  (see below). Included by every script that writes an audit entry (through includes/reject
  and includes/fence, or itself: register-2, relay-6, resolve-6).
]]
-- HMAC-SHA1 (RFC 2104) from redis.sha1hex; the key never stays in Redis.
local function hex_to_bytes(hex)
  return (hex:gsub('..', function(h) return string.char(tonumber(h, 16)) end))
end

local function hmac(key, msg)
  if #key > 64 then key = hex_to_bytes(redis.sha1hex(key)) end
  key = key .. string.rep('\0', 64 - #key)
  local ipad, opad = {}, {}
  for i = 1, 64 do
    local b = key:byte(i)
    ipad[i] = string.char(bit.bxor(b, 0x36))
    opad[i] = string.char(bit.bxor(b, 0x5c))
  end
  local inner = hex_to_bytes(redis.sha1hex(table.concat(ipad) .. msg))
  return redis.sha1hex(table.concat(opad) .. inner)
end

-- Append an entry to the job's audit stream (same slot as the decision), chained:
-- each entry carries the hash of the previous one ('prev') and its own ('hash' =
-- HMAC-SHA1 with the audit key, or SHA-1 without one, over "name=value" lines of
-- every field before it). The chain head lives in the job hash; anchors of it
-- leave Redis through the gateway. fields: flat list of name, value pairs.
-- known: nil, or what the script read of the job hash in this call, kept current here:
--   {head = its audit_head ('' for none; nil: not read yet), lasting = it has a fence or a
--   cancellation} (the fence guard's read, includes/fence); nil: read here.
local function audit(stream, job, retention, now, fields, known)
  local all = {'at', fmt(now)}
  for i = 1, #fields do all[#all + 1] = fields[i] end
  all[#all + 1] = 'prev'
  if known and known.head then
    all[#all + 1] = known.head
  else
    all[#all + 1] = redis.call('HGET', job, 'audit_head') or ''
  end
  local lines = {}
  for i = 1, #all, 2 do lines[#lines + 1] = all[i] .. '=' .. all[i + 1] end
  local text = table.concat(lines, '\n')
  local hash
  if AUDIT_KEY ~= '' then hash = hmac(AUDIT_KEY, text) else hash = redis.sha1hex(text) end
  all[#all + 1] = 'hash'
  all[#all + 1] = hash
  local id = redis.call('XADD', stream, '*', unpack(all))
  redis.call('HSET', job, 'audit_head', hash, 'audit_last', id)
  redis.call('EXPIRE', stream, retention)
  -- a job that has no fence (a rejected call for a job never registered) must not leave a
  -- key that never expires: its hash lives as long as its audit stream. A fence or a
  -- cancellation makes it permanent (PERSIST).
  local lasting
  if known then
    known.head = hash
    lasting = known.lasting
  else
    lasting = redis.call('HEXISTS', job, 'fence') == 1 or redis.call('HEXISTS', job, 'cancelled') == 1
  end
  if not lasting then redis.call('EXPIRE', job, retention) end
  return id
end
