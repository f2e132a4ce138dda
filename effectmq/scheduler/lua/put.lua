--[[ put: create or replace a schedule's definition.
KEYS: the scheduler keys of lib.lua, then the schedule's hash.
ARGV[1] id  ARGV[2] spec (JSON)  ARGV[3] timing ("cron|zone")  ARGV[4] suspend (1|0)
A new schedule's cursor starts at now (earlier ticks are not due). When the timing
changes, the cursor moves up to now, so the new cron does not replay the past.
Otherwise the cursor stays: ticks missed while suspended go through the missed policy,
all of them missed whatever their age: a suspension records suspended_at, a resume
resumed_at (lib.lua's suspension()). A suspension while the ticks of the last one are
not settled yet (resumed after the cursor) keeps its start: one stretch.
Not suspended: due now (the caller computes the next fire time); suspended: not due.
Returns: {version, cursor, now}
]]
local id = ARGV[1]
local key = schedule_key(id)
local now = now_ms()
local old = redis.call('HMGET', key, 'cursor', 'timing', 'version', 'suspended', 'suspended_at', 'resumed_at')
local cursor = tonumber(old[1])
if not cursor then
  cursor = now
  write('HSET', key, 'created_at', now, 'materialized', 0, 'skipped', 0, 'coalesced', 0, 'backfilled', 0)
  write('ZADD', K_INDEX, 0, id)
elseif old[2] ~= ARGV[3] and cursor < now then
  cursor = now
end
local window = {}
if ARGV[4] == '1' and old[4] ~= '1' then
  if not (tonumber(old[5]) and tonumber(old[6]) and tonumber(old[6]) > cursor) then
    window = {'suspended_at', now}
  end
elseif ARGV[4] ~= '1' and old[4] == '1' then
  window = {'resumed_at', now}
  if not tonumber(old[5]) then  -- suspended before suspensions were recorded: since the cursor
    window[3] = 'suspended_at'; window[4] = cursor
  end
end
local version = (tonumber(old[3]) or 0) + 1
write('HSET', key, 'version', version, 'spec', ARGV[2], 'timing', ARGV[3], 'cursor', cursor, 'suspended', ARGV[4],
  'updated_at', now, unpack(window))
if ARGV[4] == '1' then
  write('ZREM', K_DUE, id)
  write('HDEL', key, 'next_tick')
else
  write('ZADD', K_DUE, 0, id)
end
changed(id)
commit()
return {version, cursor, now}
