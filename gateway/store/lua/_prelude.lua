--[[
  Prelude of every fencegate script. gateway.store loads each script as

      <this prelude>
      return run_script(function() <the script's body> end)

  The store appends a trailer to every call, the same for all scripts; the prelude
  takes it off before the body runs, so a body sees only its own KEYS and ARGV:

    KEYS[#KEYS - 1]  request key    fg:{t/j}:req:<request id>  (the job's slot)
    KEYS[#KEYS]      slot marker    fg:marker:{<s>}            (the job's slot)
    ARGV[#ARGV - 3]  request id (unique per call; the same when a call is re-sent)
    ARGV[#ARGV - 2]  how long a reply is remembered for a re-send, ms
    ARGV[#ARGV - 1]  the highest value of this slot's marker the gateway has seen
    ARGV[#ARGV]      the audit chain key ('' for an unkeyed chain)

  Three guarantees, for every script:

  * Re-send safety. A body that changes anything returns through done(reply),
    which remembers the reply under the request key. A call that is re-sent
    (the connection dropped after the script ran; a timed-out call sent again
    to learn its verdict) gets the remembered reply and changes nothing more.
  * Fail closed on lost data. The slot marker is written by `fencegate init`;
    missing, the slot lost its data: {8} and nothing is done. Its value is a
    counter that every write in the slot raises (done()), so it only rises; a
    value below what the gateway has seen means the slot went back in time (a
    restored backup, a lost tail of writes): {8, 'behind', seen} and nothing done.
  * The reply is prefixed with the slot's counter, for the gateway's high-water
    mark: {seq, code, ...}. The store strips it.

  Result codes shared by all scripts (first element after the counter):
    0 OK / ADMITTED / CREATED
    1 REPLAY / ALREADY CURRENT / LOST (script-specific, see each header)
    2 IN_PROGRESS
    3 UNKNOWN / NOTHING TO DO
    8 DATA LOST: {8} marker missing; {8, 'behind', seen} the slot went back in time
    9 REJECTED: {9, reason, presented, current, audit_id, pinned_sha}
   10 VOIDED: the gateway gave this request up before it ran; it does nothing
  Numbers cross the boundary as decimal strings: Lua numbers are doubles, exact
  up to 2^53, and tostring() would print large ones in exponent form.
]]
redis.replicate_commands()

local AUDIT_KEY = table.remove(ARGV)
local SEEN = tonumber(table.remove(ARGV)) or 0
local REQ_TTL = table.remove(ARGV)
local REQ_ID = table.remove(ARGV)
local MARKER = table.remove(KEYS)
local REQ_KEY = table.remove(KEYS)
local SEQ = 0
local wrote = false

-- Milliseconds from the Redis clock: one clock for every gateway instance.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function fmt(n)
  return string.format('%.0f', n)
end

-- Every change a body makes ends here: the slot's counter rises (once per call)
-- and the reply is remembered for a re-send of the same request.
local function done(reply)
  if not wrote then
    wrote = true
    if SEQ == 0 then
      redis.call('SET', MARKER, '1')
      SEQ = 1
    else
      SEQ = redis.call('INCR', MARKER)
    end
  end
  redis.call('SET', REQ_KEY, cjson.encode(reply), 'PX', REQ_TTL)
  return reply
end

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
local function audit(stream, job, retention, now, fields)
  local all = {'at', fmt(now)}
  for i = 1, #fields do all[#all + 1] = fields[i] end
  all[#all + 1] = 'prev'
  all[#all + 1] = redis.call('HGET', job, 'audit_head') or ''
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
  if redis.call('HEXISTS', job, 'fence') == 0 and redis.call('HEXISTS', job, 'cancelled') == 0 then
    redis.call('EXPIRE', job, retention)
  end
  return id
end

-- The "needs a decision" index of this slot (fg:nd:{<s>}, the job's slot): a sorted set of
-- queue members [tenant, job, step], holding every step whose outcome is unknown (score:
-- when it became unknown) or that is dispatching (score: its deadline). So ZRANGEBYSCORE
-- -inf <now> finds exactly the steps an operator may have to decide: every unknown, and
-- every dispatch past its deadline. Every script that changes a step's state calls this with
-- the new state, atomically with the change (the per-tenant hint is written after it).
local function index(key, member, state, score)
  if state == 'unknown' or state == 'dispatching' then
    redis.call('ZADD', key, score, member)
  else
    redis.call('ZREM', key, member)
  end
end

local function run_script(body)
  local prior = redis.call('GET', REQ_KEY)
  local reply
  if prior then
    reply = cjson.decode(prior)
    SEQ = tonumber(redis.call('GET', MARKER)) or 0
  else
    local marker = redis.call('GET', MARKER)
    if not marker then return {'0', 8} end
    SEQ = tonumber(marker) or 0
    if SEQ < SEEN then return {fmt(SEQ), 8, 'behind', fmt(SEEN)} end
    reply = body()
  end
  table.insert(reply, 1, fmt(SEQ))
  return reply
end
