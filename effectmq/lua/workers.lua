--[[ workers: record this worker's load; with no name, list the live workers of the queue
(dropping the entries past their expiry; live_workers.lua only lists).
KEYS: the queue keys of keys.lua.
ARGV[1] name         empty: only list (as versions before live_workers.lua did)
ARGV[2] in_flight    -1: the worker is leaving
ARGV[3] concurrency
ARGV[4] ttl_ms       how long the entry stays live without news
Returns: {workers...}  a listing's live workers; an announcement lists none. It looks at
  two other entries, at random, and drops those past their expiry: O(1) per announcement,
  where reading every entry made the announcements of W workers cost O(W^2). The hash holds
  one entry per worker process, so an entry left a while longer loses nothing.
workers...: 3 values each: name, in_flight, concurrency
]]
--- @include "keys"
--- @include "time"
--- @include "writes"
--- @include "workers"
local SWEPT_PER_ANNOUNCEMENT = 2
local now = now_ms()
if ARGV[1] == '' then
  local out = live_workers(now, true)
  commit()
  return out
end
local others = redis.call('HRANDFIELD', K_WORKERS, SWEPT_PER_ANNOUNCEMENT, 'WITHVALUES')
-- The entry is dropped first, a write that frees: a full Redis still lists the worker (FIRST_WRITE_FREES).
write('HDEL', K_WORKERS, ARGV[1])
if (tonumber(ARGV[2]) or -1) >= 0 then
  write('HSET', K_WORKERS, ARGV[1], ARGV[2] .. ' ' .. ARGV[3] .. ' ' .. int_text(now + (tonumber(ARGV[4]) or 0)))
end
for i = 1, #others, 2 do
  local expires = tonumber(string.match(others[i + 1], '(%S+)$'))
  if others[i] ~= ARGV[1] and (expires == nil or expires < now) then write('HDEL', K_WORKERS, others[i]) end
end
commit()
return {}
