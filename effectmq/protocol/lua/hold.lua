--[[ hold: hold the starts of the queue's tasks until Redis time plus `hold_ms` (a downstream
service answered 429 with a Retry-After: TaskQueue.hold_starts, a handler's RateLimited):
acquire leases nothing before then and answers rate_limited (rate.lua). A hold is only ever
extended, never shortened: meta held_until_ms keeps the later end.
KEYS: the queue keys of keys.lua.
ARGV[1] hold_ms  how long from now, at most MAX_HOLD_MS (protocol.MAX_HOLD)
Returns: {now, held_until}  held_until: the Redis time (ms) the hold ends, this one or a
  later one already set
]]
--- @include "call"
--- @include "keys"
--- @include "time"
--- @include "writes"
--- @include "meta"
--- @include "rate"
local now = now_ms()
local hold = math.min(math.max(math.floor(tonumber(ARGV[1]) or 0), 0), MAX_HOLD_MS)
local held = held_until() or now
if now + hold > held then
  held = now + hold
  write('HSET', K_META, 'held_until_ms', int_text(held))
end
commit()
return {now, held}
