--[[
  Record a staged output after its bytes were written (gateway.outputs): size, sha256,
  content type. Fenced again: if the fence moved (or the job was cancelled or completed)
  while the bytes streamed, the record is refused and audited, and the object stays an
  orphan that is never promoted (the sweeper deletes it).

  Input (the prelude's trailer follows):
    KEYS[1] job hash          fg:{t/j}:job
    KEYS[2] outputs hash      fg:{t/j}:outputs
    KEYS[3] job audit stream  fg:{t/j}:audit
    ARGV[1..8] the fenced call (includes/fence): generation, mode (the record never raises
             the fence: read as 'required'), job id, tenant, worker id, retention (audit
             stream), who calls, rejections unaudited
    ARGV[9]  output name   ARGV[10] upload id from the stage
    ARGV[11] size, bytes   ARGV[12] sha256 (hex)   ARGV[13] content type   ARGV[14] etag
    ARGV[15] 'record' | 'abandon' (the upload failed: its claim ends, nothing recorded)

  Output:
    {0, entry_json}       recorded (abandon: the claim was dropped)
    {1, state}            lost: another stage of this output replaced this upload
    {9, reason, presented, current, audit_id, ''}   rejected and audited

  The lease is not checked: the stage checked it, and a lease that ran out without a
  new generation leaves the fence where it was.
]]
--- @include "includes/fence"
local field = ARGV[1] .. '/' .. ARGV[9]
local prior = redis.call('HGET', KEYS[2], field)
if not prior then return {1, ''} end
local entry = cjson.decode(prior)
if entry.upload ~= ARGV[10] then return {1, entry.state} end

if ARGV[15] == 'abandon' then
  if entry.state ~= 'staged' then return {1, entry.state} end
  entry.deadline = 0
  redis.call('HSET', KEYS[2], field, cjson.encode(entry))
  return done({0, cjson.encode(entry)})
end

local now = now_ms()
-- the record never raises the fence (its stage did): above the fence is unregistered,
-- whatever the registration mode; the lease is not checked (see above)
local call = fenced_call(ARGV, KEYS[1], KEYS[3], 'output:' .. ARGV[9], '', now)
call.mode = 'required'
call.leaseless = true
local g = fence_guard(call, {'cancelled', 'completed', 'stale'})
if g.reply then return g.reply end

if entry.state == 'recorded' then return {0, prior} end  -- already recorded: nothing new
entry.state = 'recorded'
entry.size = tonumber(ARGV[11])
entry.sha256 = ARGV[12]
entry.content_type = ARGV[13]
entry.etag = ARGV[14]
entry.recorded_ms = now
entry.deadline = 0
local encoded = cjson.encode(entry)
redis.call('HSET', KEYS[2], field, encoded)
return done({0, encoded})
