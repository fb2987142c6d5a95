--[[
  Complete a job: the one conditional write that decides which generation's work is the
  job's result. Checks cancel, fence, lease and "not completed yet", and that every named
  output was recorded by *this* generation; then marks the job completed by it and
  promotes those outputs (the job's official reference points at generation g's objects).

  Input (the prelude's trailer follows):
    KEYS[1] job hash          fg:{t/j}:job
    KEYS[2] outputs hash      fg:{t/j}:outputs  (field <generation>/<name> -> JSON record)
    KEYS[3] job audit stream  fg:{t/j}:audit
    ARGV[1..8] the fenced call (includes/fence): generation, mode, job id, tenant, worker id,
            retention, who calls, the tenant's rejections
    ARGV[9]  sha256 of the canonical request body (hex): a repeat with the same body replays
    ARGV[10] result, canonical JSON ('null' for none)
    ARGV[11] output names, a JSON array of strings (checked by the gateway: names, unique)

  The job hash's field 'completed' (written as text, never re-encoded by Lua):
    {"generation":g,"at_ms":ms,"result":<json>,"outputs":{"<name>":{"generation":g,
     "key":…,"size":…,"sha256":…,"content_type":…}},"body_sha":"<hex>"}

  Output:
    {0, completed}   completed now
    {1, completed}   replay: this generation completed with the same body already
    {7, missing}     an output is not recorded by this generation (JSON array of names);
                     nothing changed (except a fence raised in implicit mode)
    {9, reason, presented, current, audit_id, ''}   rejected and audited
      (job_cancelled, stale_generation, unregistered_generation, lease_expired,
       job_completed: completed already, by this generation with another body)

  The fence guard (includes/fence), in order: cancelled, stale, completed (the same
  generation and body replay), then above the fence unregistered (mode 'required') or the
  raise (mode 'implicit', no lease), at the fence the lease. The audit entry names the step 'job:complete' (':' is never in a step name).
]]
--- @include "includes/fence"
local now = now_ms()
-- nothing raises the fence after a completion: the completing generation is the fence
local function replay()
  local completed = redis.call('HGET', KEYS[1], 'completed')
  local by = string.match(completed, '^{"generation":(%d+),')
  local sha = string.match(completed, ',"body_sha":"(%x+)"}$')
  if by == ARGV[1] and sha == ARGV[9] then return {1, completed} end
  return nil  -- completed by another generation, or with another body: job_completed
end
local call = fenced_call(ARGV, KEYS[1], KEYS[3], 'job:complete', '', now)
local g = fence_guard(call, {'cancelled', 'stale', 'completed'}, replay)
if g.reply then return g.reply end

local names = cjson.decode(ARGV[11])
local missing = {}
local promoted = {}
for i = 1, #names do
  local name = names[i]
  local raw = redis.call('HGET', KEYS[2], ARGV[1] .. '/' .. name)
  local ok, rec = false, nil
  if raw then ok, rec = pcall(cjson.decode, raw) end
  if not ok or type(rec) ~= 'table' or rec.state ~= 'recorded' or type(rec.key) ~= 'string'
      or type(rec.size) ~= 'number' or type(rec.sha256) ~= 'string' then
    missing[#missing + 1] = name
  else
    local ctype = rec.content_type
    if type(ctype) ~= 'string' then ctype = 'application/octet-stream' end
    promoted[#promoted + 1] = cjson.encode(name) .. ':{"generation":' .. ARGV[1] ..
      ',"key":' .. cjson.encode(rec.key) .. ',"size":' .. fmt(rec.size) ..
      ',"sha256":' .. cjson.encode(rec.sha256) .. ',"content_type":' .. cjson.encode(ctype) ..
      '}'
  end
end
if #missing > 0 then
  local reply = {7, cjson.encode(missing)}
  if g.raised then return done(reply) end
  return reply
end

local completed = '{"generation":' .. ARGV[1] .. ',"at_ms":' .. fmt(now) .. ',"result":' .. ARGV[10] ..
  ',"outputs":{' .. table.concat(promoted, ',') .. '},"body_sha":"' .. ARGV[9] .. '"}'
redis.call('HSET', KEYS[1], 'completed', completed)
redis.call('PERSIST', KEYS[1])  -- a completion never expires
return done({0, completed})
