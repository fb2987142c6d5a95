--[[
  Record a staged output after its bytes were written (gateway.outputs): size, sha256,
  content type. Fenced again: if the fence moved (or the job was cancelled or completed)
  while the bytes streamed, the record is refused and audited, and the object stays an
  orphan that is never promoted (the sweeper deletes it).

  Input (the prelude's trailer follows):
    KEYS[1] job hash          fg:{t/j}:job
    KEYS[2] outputs hash      fg:{t/j}:outputs
    KEYS[3] job audit stream  fg:{t/j}:audit
    ARGV[1]  generation (decimal)   ARGV[2] output name   ARGV[3] upload id from the stage
    ARGV[4]  size, bytes   ARGV[5] sha256 (hex)   ARGV[6] content type   ARGV[7] etag
    ARGV[8]  job id   ARGV[9] tenant   ARGV[10] worker id   ARGV[11] retention, seconds
    ARGV[12] 'record' | 'abandon' (the upload failed: its claim ends, nothing recorded)

  Output:
    {0, entry_json}       recorded (abandon: the claim was dropped)
    {1, state}            lost: another stage of this output replaced this upload
    {9, reason, presented, current, audit_id, ''}   rejected and audited

  The lease is not checked: the stage checked it, and a lease that ran out without a
  new generation leaves the fence where it was.
]]
--- @include "includes/reject"
local field = ARGV[1] .. '/' .. ARGV[2]
local prior = redis.call('HGET', KEYS[2], field)
if not prior then return {1, ''} end
local entry = cjson.decode(prior)
if entry.upload ~= ARGV[3] then return {1, entry.state} end

if ARGV[12] == 'abandon' then
  if entry.state ~= 'staged' then return {1, entry.state} end
  entry.deadline = 0
  redis.call('HSET', KEYS[2], field, cjson.encode(entry))
  return done({0, cjson.encode(entry)})
end

local gen = tonumber(ARGV[1])
local now = now_ms()
local job = redis.call('HMGET', KEYS[1], 'fence', 'cancelled')
local fence = tonumber(job[1]) or 0
local call = {job = KEYS[1], stream = KEYS[3], retention = ARGV[11], now = now,
  tenant = ARGV[9], job_id = ARGV[8], step = 'output:' .. ARGV[2], presented = ARGV[1],
  worker_id = ARGV[10], adapter = ''}
local function reject(reason) return reject_call(call, reason, fence) end

if job[2] == '1' then return reject('job_cancelled') end
if redis.call('HEXISTS', KEYS[1], 'completed') == 1 then return reject('job_completed') end
if gen < fence then return reject('stale_generation') end
if gen > fence then return reject('unregistered_generation') end

if entry.state == 'recorded' then return {0, prior} end  -- already recorded: nothing new
entry.state = 'recorded'
entry.size = tonumber(ARGV[4])
entry.sha256 = ARGV[5]
entry.content_type = ARGV[6]
entry.etag = ARGV[7]
entry.recorded_ms = now
entry.deadline = 0
local encoded = cjson.encode(entry)
redis.call('HSET', KEYS[2], field, encoded)
return done({0, encoded})
