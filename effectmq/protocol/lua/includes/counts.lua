-- counts.lua: tasks settled per minute, for throughput charts.
--- @include "call"
--- @include "keys"
--- @include "writes"
--- @include "time"

-- Tasks settled per minute (completed and failed for good), for throughput charts:
-- counted in the call and written once at its end (count_settled, then flush_counts).
local MINUTE_SLOTS = 180  -- three hours of minutes; a slot is reused when its minute comes again
local function count_settled(state)
  if state == 'completed' or state == 'failed' then
    call.counts[state] = (call.counts[state] or 0) + 1
  end
end
local function flush_counts()
  local c, f = call.counts['completed'] or 0, call.counts['failed'] or 0
  if c == 0 and f == 0 then return end
  local minute = math.floor(now_ms() / 60000)
  local slot, minute_text = int_text(minute % MINUTE_SLOTS), int_text(minute)
  if redis.call('HGET', K_MINUTES, 'm:' .. slot) == minute_text then
    if c > 0 then write('HINCRBY', K_MINUTES, 'c:' .. slot, int_text(c)) end
    if f > 0 then write('HINCRBY', K_MINUTES, 'f:' .. slot, int_text(f)) end
  else
    write('HSET', K_MINUTES, 'm:' .. slot, minute_text, 'c:' .. slot, int_text(c), 'f:' .. slot, int_text(f))
  end
  call.counts = {}
end
