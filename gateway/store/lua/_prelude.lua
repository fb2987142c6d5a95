--[[
  Prelude of every fencegate script. gateway.store loads each script as

      <this prelude>
      <the includes the script names: --- @include "includes/<name>">
      return run_script(function() <the script's body> end)

  Here: the trailer, now_ms(), fmt(), done() and run_script(). The audit chain
  (includes/audit), the tenant feed copy (includes/feed), the "needs a decision" index
  (includes/index), the relay's queue entry and hint (includes/relayq), the audited
  rejection (includes/reject) and the fence guard (includes/fence) are included by the
  scripts that use them.

  The store appends a trailer to every call, the same for all scripts; the prelude
  takes it off before the body runs, so a body sees only its own KEYS and ARGV:

    KEYS[#KEYS - 1]  request key    fg:{t/j}:req:<request id>  (the job's slot)
    KEYS[#KEYS]      slot marker    fg:marker:{<s>}            (the job's slot)
    ARGV[#ARGV - 4]  request id (unique per call; the same when a call is re-sent)
    ARGV[#ARGV - 3]  how long a reply is remembered for a re-send, ms
    ARGV[#ARGV - 2]  the highest value of this slot's marker the gateway has seen
    ARGV[#ARGV - 1]  the audit chain key ('' for an unkeyed chain)
    ARGV[#ARGV]      the job's tenant feed fg:audit:<tenant>, where the script copies the
                     audit entries the feed lists (includes/feed); '' on a Cluster, where the
                     feed lives in another slot and the store copies them after the script

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

local FEED = table.remove(ARGV)
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
-- remembered: what a re-send is answered, when not the reply itself (a reply carrying bulk
-- a re-send can read again, e.g. the relay claim's payload)
local function done(reply, remembered)
  if not wrote then
    wrote = true
    if SEQ == 0 then
      redis.call('SET', MARKER, '1')
      SEQ = 1
    else
      SEQ = redis.call('INCR', MARKER)
    end
  end
  redis.call('SET', REQ_KEY, cjson.encode(remembered or reply), 'PX', REQ_TTL)
  return reply
end

local function run_script(body)
  local got = redis.call('MGET', REQ_KEY, MARKER)  -- one slot: the job's
  local prior, marker = got[1], got[2]
  local reply
  if prior then
    reply = cjson.decode(prior)
    SEQ = tonumber(marker) or 0
  else
    if not marker then return {'0', 8} end
    SEQ = tonumber(marker) or 0
    if SEQ < SEEN then return {fmt(SEQ), 8, 'behind', fmt(SEEN)} end
    reply = body()
  end
  table.insert(reply, 1, fmt(SEQ))
  return reply
end
