--[[
  The peer: POST /v1/jobs/{job}/effects/{step} answered by fencegate's own admit script from
  nginx + Lua (docs/performance.md, "The peer"). A benchmark prototype, not a server to run: it trusts
  its input (no authentication, no shape check beyond what the digest needs) and answers only
  what a replay and a stale call answer; anything else is a 501 naming the script's code.

  Input: plan.json (written by benchmarks/peer/plan.py before nginx starts):
    sha         the SHA1 of admit-8 as the store assembles it (prelude + includes + body),
                SCRIPT LOADed into the bench's Redis
    numkeys     how many of `args` are KEYS
    args        the EVALSHA arguments after numkeys, each a list of pieces: a literal string, or
                {name} for a per-call value (job, step, slot, gen, sha, rid, adapter,
                operation, run_before): captured from the running gateway's own admit
    run_before_offset_ms   ARGV "run before" = now + this (the gateway's request memory)
    slot_tags   the short hash tag of every slot (gateway.store.keys.slot_tags), by slot
    redis_host, redis_port, tenant, feed_key, retention_ms
    feed_in_script  the admit's trailer names the tenant feed: the script copies a rejection
                there itself, so $peer_feed adds no copy of its own

  Output (byte-identical to the gateway's, status and body):
    {seq, 1, field, value, ...}   replay: 200 application/json, the stored result as stored
    {seq, 9, reason, presented, current, audit_id, pinned}
                                  409 application/problem+json; with $peer_feed = 1 the
                                  audit entry is also copied to the tenant's feed (XADD)
]]
local cjson = require "cjson"
local redis = require "nginx.redis" -- Debian's name for lua-resty-redis
local ffi = require "ffi"
local bit = require "bit"

ffi.cdef [[
unsigned char *SHA256(const unsigned char *d, size_t n, unsigned char *md);
]]

local _M = {}
local plan
local md = ffi.new("unsigned char[32]")
local counter = 0
local rid_prefix

local PROBLEM_BASE = "https://fencegate.dev/problems/"
local TITLES = {
  stale_generation = "Generation is below the job's fence",
}
local DETAILS = {
  stale_generation = "generation %s is below the job's fence %s; stop working on this job",
}

function _M.init(path)
  local f = assert(io.open(path, "rb"))
  plan = cjson.decode(f:read("*a"))
  f:close()
  rid_prefix = "peer" .. string.format("%x", math.floor(ngx.now() * 1000)) .. "-"
end

-- SHA-256 hex from the libcrypto nginx links (no lua-resty-string in Debian)
local function sha256_hex(s)
  ffi.C.SHA256(s, #s, md)
  local out = {}
  for i = 0, 31 do out[i + 1] = string.format("%02x", md[i]) end
  return table.concat(out)
end

-- CRC16-XMODEM mod 16384: the Redis Cluster slot of a hash tag (gateway.store.keys.key_slot);
-- the slot's own keys (marker, relay queue, index) carry its short tag, plan.slot_tags
local CRC = {}
for i = 0, 255 do
  local c = bit.lshift(i, 8)
  for _ = 1, 8 do
    if bit.band(c, 0x8000) ~= 0 then c = bit.bxor(bit.lshift(c, 1), 0x1021)
    else c = bit.lshift(c, 1) end
  end
  CRC[i] = bit.band(c, 0xffff)
end
local function slot(tag)
  local crc = 0
  for i = 1, #tag do
    crc = bit.band(bit.bxor(bit.lshift(crc, 8), CRC[bit.bxor(bit.rshift(crc, 8), tag:byte(i))]),
      0xffff)
  end
  return crc % 16384
end

-- canonical JSON (gateway.core.intents.canonical_json): sorted keys, no whitespace, only '"',
-- '\' and control characters escaped. An empty object and an empty array both decode to {}
-- (Debian's cjson has no array marker): encoded {}; integers as integers.
local ESC = {['"'] = '\\"', ['\\'] = '\\\\', ['\n'] = '\\n', ['\r'] = '\\r', ['\t'] = '\\t',
  ['\b'] = '\\b', ['\f'] = '\\f'}
local function escape(s)
  return '"' .. s:gsub('[%c"\\]', function(c)
    return ESC[c] or string.format("\\u%04x", c:byte())
  end) .. '"'
end
local canonical
canonical = function(v)
  local t = type(v)
  if t == "string" then return escape(v) end
  if t == "number" then
    if v == math.floor(v) and math.abs(v) < 2 ^ 53 then return string.format("%d", v) end
    return string.format("%.17g", v)
  end
  if t == "boolean" then return v and "true" or "false" end
  if v == nil or v == cjson.null then return "null" end
  if #v > 0 then
    local out = {}
    for i = 1, #v do out[i] = canonical(v[i]) end
    return "[" .. table.concat(out, ",") .. "]"
  end
  local names = {}
  for k in pairs(v) do names[#names + 1] = k end
  table.sort(names)
  local out = {}
  for i, k in ipairs(names) do out[i] = escape(k) .. ":" .. canonical(v[k]) end
  return "{" .. table.concat(out, ",") .. "}"
end

local function args_for(values)
  local out = {}
  for i, pieces in ipairs(plan.args) do
    local parts = {}
    for j, piece in ipairs(pieces) do
      if type(piece) == "string" then parts[j] = piece else parts[j] = values[piece[1]] end
    end
    out[i] = table.concat(parts)
  end
  return out
end

local function connect()
  local red = redis:new()
  red:set_timeout(5000)
  local ok, err = red:connect(plan.redis_host, plan.redis_port)
  if not ok then return nil, err end
  return red
end

local function answer(status, content_type, body)
  ngx.status = status
  ngx.header["Content-Type"] = content_type
  ngx.header["Content-Length"] = #body
  ngx.print(body)
end

local function replay(job, step, fields)
  local rec = {}
  for i = 1, #fields, 2 do rec[fields[i]] = fields[i + 1] end
  local result = rec.result
  if result == nil or result == "" then result = "null" end
  ngx.header["Idempotent-Replayed"] = "true"
  answer(200, "application/json", table.concat({
    '{"job_id":"', job, '","step":"', step, '","generation":', rec.generation,
    ',"state":"succeeded","replayed":true,"idempotency_key":"', job, ":", step,
    '","adapter":', escape(rec.adapter or ""), ',"result":', result, "}"}))
end

local function rejected(red, job, step, adapter, reply)
  local reason, presented, current, audit_id, pinned =
    reply[3], reply[4], reply[5], reply[6], reply[7]
  if ngx.var.peer_feed == "1" and audit_id ~= "" and not plan.feed_in_script then
    -- the tenant feed copy (gateway.store.base._to_feed), after the decision as there
    local min_id = string.format("%d-0", math.floor(ngx.now() * 1000) - plan.retention_ms)
    local _, err = red:xadd(plan.feed_key, "MINID", "~", min_id, "*",
      "at", audit_id:match("^(%d+)"), "tenant", plan.tenant, "job_id", job,
      "job_audit_id", audit_id, "step", step, "reason", reason, "presented", presented,
      "current", current, "worker_id", "", "adapter", adapter)
    if err then ngx.log(ngx.ERR, "feed copy failed: ", err) end
  end
  local title = TITLES[reason]
  if not title then return answer(501, "text/plain", "peer: no answer for " .. reason) end
  local doc = {'{"type":"', PROBLEM_BASE, reason, '","title":', escape(title),
    ',"status":409,"detail":', escape(string.format(DETAILS[reason], presented, current)),
    ',"code":"', reason, '","presented":', presented ~= "" and presented or "null",
    ',"current":', current}
  if pinned ~= "" then doc[#doc + 1] = ',"pinned_intent_sha256":"' .. pinned .. '"' end
  doc[#doc + 1] = "}"
  answer(409, "application/problem+json", table.concat(doc))
end

function _M.effect()
  local job, step = ngx.var.job, ngx.var.step
  ngx.req.read_body()
  local body = cjson.decode(ngx.req.get_body_data())
  counter = counter + 1
  local values = {
    job = job, step = step, slot = plan.slot_tags[slot(plan.tenant .. "/" .. job) + 1],
    gen = ngx.var.http_fencing_token, adapter = body.adapter, operation = body.operation,
    sha = sha256_hex(canonical({adapter = body.adapter, operation = body.operation,
      payload = body.payload})),
    rid = rid_prefix .. string.format("%x", counter),
    run_before = string.format("%d", math.floor(ngx.now() * 1000) + plan.run_before_offset_ms),
  }
  local red, err = connect()
  if not red then return answer(503, "text/plain", "peer: redis: " .. tostring(err)) end
  local reply
  reply, err = red:evalsha(plan.sha, plan.numkeys, unpack(args_for(values)))
  if not reply then return answer(503, "text/plain", "peer: admit: " .. tostring(err)) end
  local code = tonumber(reply[2])
  if code == 1 then
    replay(job, step, {unpack(reply, 3)})
  elseif code == 9 then
    rejected(red, job, step, body.adapter, reply)
  else
    answer(501, "text/plain", "peer: no answer for admit code " .. tostring(code))
  end
  red:set_keepalive(60000, 256)
end

return _M
