--[[
  Complete a job: the one conditional write that decides which generation's work is the
  job's result. Checks cancel, fence, lease and "not completed yet", and that every named
  output was recorded by *this* generation; then marks the job completed by it and
  promotes those outputs (the job's official reference points at generation g's objects).

  Input (the prelude's trailer follows):
    KEYS[1] job hash          fg:{t/j}:job
    KEYS[2] outputs hash      fg:{t/j}:outputs  (field <generation>/<name> -> JSON record)
    KEYS[3] job audit stream  fg:{t/j}:audit
    ARGV[1] generation presented (decimal)
    ARGV[2] registration mode: 'required' | 'implicit'
    ARGV[3] sha256 of the canonical request body (hex): a repeat with the same body replays
    ARGV[4] result, canonical JSON ('null' for none)
    ARGV[5] output names, a JSON array of strings (checked by the gateway: names, unique)
    ARGV[6] worker id ('' if none, for the audit entry)
    ARGV[7] job id   ARGV[8] tenant   ARGV[9] retention, seconds
    ARGV[10] who calls (the key's name, else its role; '' when not given): recorded with an
             implicit registration (the fence raised in implicit mode: 'event' = 'registered')

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

  The audit entry names the step 'job:complete' (':' is never in a step name).
]]
local gen = tonumber(ARGV[1])
local now = now_ms()
local job = redis.call('HMGET', KEYS[1], 'fence', 'cancelled', 'lease_exp', 'completed')
local fence = tonumber(job[1]) or 0
local raised = false

local function reject(reason)
  local id = audit(KEYS[3], KEYS[1], ARGV[9], now, {
    'tenant', ARGV[8], 'job_id', ARGV[7], 'step', 'job:complete', 'reason', reason,
    'presented', ARGV[1], 'current', fmt(fence), 'worker_id', ARGV[6], 'adapter', ''})
  return done({9, reason, ARGV[1], fmt(fence), id, ''})
end

if job[2] == '1' then return reject('job_cancelled') end
if gen < fence then return reject('stale_generation') end
local completed = job[4]
if completed then
  -- nothing raises the fence after a completion: the completing generation is the fence
  local by = string.match(completed, '^{"generation":(%d+),')
  local sha = string.match(completed, ',"body_sha":"(%x+)"}$')
  if by == ARGV[1] and sha == ARGV[3] then return {1, completed} end
  return reject('job_completed')
end
if gen > fence then
  if ARGV[2] ~= 'implicit' then return reject('unregistered_generation') end
  -- implicit mode: classic highest-seen fencing; a new generation has no lease
  redis.call('HSET', KEYS[1], 'fence', ARGV[1], 'lease_exp', '0')
  redis.call('PERSIST', KEYS[1])  -- a fence never expires
  audit(KEYS[3], KEYS[1], ARGV[9], now, {
    'tenant', ARGV[8], 'job_id', ARGV[7], 'event', 'registered', 'generation', ARGV[1],
    'previous', fmt(fence), 'by', ARGV[10] or '', 'mode', 'implicit', 'worker_id', ARGV[6]})
  fence = gen
  raised = true
else
  local lease_exp = tonumber(job[3]) or 0
  if lease_exp > 0 and now >= lease_exp then return reject('lease_expired') end
end

local names = cjson.decode(ARGV[5])
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
  if raised then return done(reply) end
  return reply
end

completed = '{"generation":' .. ARGV[1] .. ',"at_ms":' .. fmt(now) .. ',"result":' .. ARGV[4] ..
  ',"outputs":{' .. table.concat(promoted, ',') .. '},"body_sha":"' .. ARGV[3] .. '"}'
redis.call('HSET', KEYS[1], 'completed', completed)
redis.call('PERSIST', KEYS[1])  -- a completion never expires
return done({0, completed})
