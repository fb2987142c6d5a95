--[[
  A plain script's re-send memory. The auto-pipeline sends a call again when its connection
  dropped before the reply came (gateway.store.batching): a script that adds to a counter
  must not add twice. The call's first run keeps its (integer) reply under the call's own
  key for ``ms``; a run that finds it answers that reply and changes nothing.

    once(key, ms, run) -> run()'s reply, or the one remembered for key
]]
local function once(key, ms, run)
  local seen = redis.call('GET', key)
  if seen then return tonumber(seen) end
  local reply = run()
  redis.call('SET', key, tostring(reply), 'PX', ms)
  return reply
end
