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
             stream), who calls, the tenant's rejections
    ARGV[9]  output name   ARGV[10] upload id from the stage
    ARGV[11] size, bytes   ARGV[12] sha256 (hex)   ARGV[13] content type   ARGV[14] etag
    ARGV[15] 'record' | 'abandon' (the upload failed: its claim ends, nothing recorded)
             | 'copy' (a completion copies a pre-signed upload's staged object to the
             output's key: claim that copy for ARGV[11] ms) | 'uncopy' (that copy failed:
             its claim ends)
    ARGV[16] the copy's id ('' for an upload through the gateway): a 'record' must present
             the copy claim the entry holds, so only the copy that wrote the output's key
             records it

  Output:
    {0, entry_json}       recorded (abandon: the claim was dropped; copy: claimed)
    {1, state}            lost: another stage of this output replaced this upload (record:
                          or another copy holds the entry; copy: or it is recorded already)
    {2, retry_after_ms}   copy: another copy of this upload is still running
    {9, reason, presented, current, audit_id, ''}   rejected and audited

  A copy claim is fenced like a record. While one runs (copy_deadline ahead) no other copy
  of the upload starts, and output-stage-3 stages nothing over it: two writers of the
  output's key at once could leave bytes that its record does not describe.

  The lease is not checked: the stage checked it, and a lease that ran out without a
  new generation leaves the fence where it was.
]]
--- @include "includes/fence"
local field = ARGV[1] .. '/' .. ARGV[9]
local prior = redis.call('HGET', KEYS[2], field)
if not prior then return {1, ''} end
local entry = cjson.decode(prior)
if entry.upload ~= ARGV[10] then return {1, entry.state} end

local copy = ARGV[16] or ''
if ARGV[15] == 'abandon' then
  if entry.state ~= 'staged' then return {1, entry.state} end
  entry.deadline = 0
  entry.copy, entry.copy_deadline = nil, nil
  redis.call('HSET', KEYS[2], field, cjson.encode(entry))
  return done({0, cjson.encode(entry)})
end
if ARGV[15] == 'uncopy' then
  if entry.state ~= 'staged' or (entry.copy or '') ~= copy then return {1, entry.state} end
  entry.copy, entry.copy_deadline = nil, nil
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

if ARGV[15] == 'copy' then
  if entry.state ~= 'staged' then return {1, entry.state} end  -- recorded: nothing to copy
  local held = tonumber(entry.copy_deadline) or 0
  if (entry.copy or '') ~= '' and held > now then
    return {2, fmt(held - now)}
  end
  entry.copy, entry.copy_deadline = copy, now + tonumber(ARGV[11])
  local claimed = cjson.encode(entry)
  redis.call('HSET', KEYS[2], field, claimed)
  return done({0, claimed})
end
if entry.state == 'recorded' then return {0, prior} end  -- already recorded: nothing new
if (entry.copy or '') ~= copy then return {1, entry.state} end  -- another copy holds it
entry.copy, entry.copy_deadline = nil, nil
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
