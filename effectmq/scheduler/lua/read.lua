--[[ read: Redis time and the definition, version and cursor of the given schedules, at
one instant (a script, not MULTI with TIME: one call to the namespace's slot on Redis
Cluster, where redis-py refuses TIME in a pipeline).
KEYS: the scheduler keys of lib.lua, then the schedule hashes.
ARGV: the schedule ids.
Returns: {now ms, {spec, version, cursor, decided, suspension} per id (nil where absent)}:
decided and suspension as due.lua returns them (a schedule lacking a version or cursor
gets neither: it is not decided from).
]]
local now = now_ms()
local out = {now}
for i, id in ipairs(ARGV) do
  local key = schedule_key(id)
  local row = redis.call('HMGET', key, 'spec', 'version', 'cursor', 'decided_at', 'suspended_at', 'resumed_at')
  local decided = false
  if row[1] and row[2] and row[3] then
    decided = decided_at(key, row[2], row[3], row[4], now)
  end
  out[i + 1] = {row[1], row[2], row[3], decided, suspension(row[5], row[6])}
end
commit()
return out
