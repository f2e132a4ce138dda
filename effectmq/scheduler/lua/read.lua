--[[ read: Redis time and the definition, version and cursor of the given schedules, at
one instant (a script, not MULTI with TIME: one call to the namespace's slot on Redis
Cluster, where redis-py refuses TIME in a pipeline).
KEYS: the scheduler keys of lib.lua, then the schedule hashes.
ARGV: the schedule ids.
Returns: {now ms, {spec, version, cursor} per id (nil where absent)}.
]]
local out = {now_ms()}
for i, id in ipairs(ARGV) do
  out[i + 1] = redis.call('HMGET', schedule_key(id), 'spec', 'version', 'cursor')
end
return out
