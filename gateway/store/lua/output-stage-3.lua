--[[
  Stage one attempt-scoped output: the fenced decision taken BEFORE any byte of it is
  written to the object store (gateway.outputs). A refused call writes nothing there.

  Input (the prelude's trailer follows):
    KEYS[1] job hash          fg:{t/j}:job
    KEYS[2] outputs hash      fg:{t/j}:outputs   (field '<generation>/<name>' -> JSON entry)
    KEYS[3] job audit stream  fg:{t/j}:audit
    ARGV[1..8] the fenced call (includes/fence): generation, mode, job id, tenant, worker id,
             retention (audit stream), who calls, the tenant's rejections
    ARGV[9]  output name   ARGV[10] object key ('<tenant>/<job>/g<generation>/<name>')
    ARGV[11] upload id (unique per stage; the record must present it)
    ARGV[12] how long the upload may take, ms (the gateway cuts its own upload at this
             deadline; a presigned URL expires then)
    ARGV[13] '1' for a presigned upload (the bytes bypass the gateway), else '0'
    ARGV[14] declared content type

  Output:
    {0, fence, deadline_ms}                     staged: write the bytes now
    {2, retry_after_ms}                         an upload of this output by this generation
                                                through the gateway is still running, or a
                                                completion is copying its pre-signed upload
    {9, reason, presented, current, audit_id, ''}   rejected and audited

  Checks (the fence guard, includes/fence), in order: cancelled, completed (any generation),
  stale (audited with both generations), then above the fence unregistered (mode
  'required') or the raise (mode 'implicit', no lease), at the fence the lease. A recorded output of the same generation may be staged
  again (a retry overwrites its own object; after completion nothing is staged at all).
]]
--- @include "includes/fence"
local now = now_ms()
local call = fenced_call(ARGV, KEYS[1], KEYS[3], 'output:' .. ARGV[9], '', now)
local g = fence_guard(call, {'cancelled', 'completed', 'stale'})
if g.reply then return g.reply end

local field = ARGV[1] .. '/' .. ARGV[9]
local prior = redis.call('HGET', KEYS[2], field)
if prior then
  local p = cjson.decode(prior)
  -- one upload through the gateway at a time per output and generation, and none while a
  -- completion copies a pre-signed upload to the output's key (output-record-3 'copy'):
  -- two at once would race on the same key, and the record could describe the other one's
  -- bytes
  local busy = 0
  if p.state == 'staged' and not p.presigned then busy = tonumber(p.deadline) or 0 end
  if p.state == 'staged' and (p.copy or '') ~= '' then
    busy = math.max(busy, tonumber(p.copy_deadline) or 0)
  end
  if busy > now then
    local reply = {2, fmt(busy - now)}
    if g.raised then return done(reply) end
    return reply
  end
end

local deadline = now + tonumber(ARGV[12])
local entry = {
  state = 'staged', key = ARGV[10], size = 0, sha256 = '', content_type = ARGV[14],
  staged_ms = now, recorded_ms = 0, presigned = ARGV[13] == '1', upload = ARGV[11],
  deadline = deadline, etag = '', worker_id = ARGV[5],
}
redis.call('HSET', KEYS[2], field, cjson.encode(entry))
return done({0, fmt(g.fence), fmt(deadline)})
