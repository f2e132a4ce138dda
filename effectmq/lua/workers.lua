--[[ workers: record this worker's load, and list the live workers of the queue (dropping
the entries past their expiry; live_workers.lua only lists).
KEYS: the queue keys of keys.lua.
ARGV[1] name         empty: only list (as versions before live_workers.lua did)
ARGV[2] in_flight    -1: the worker is leaving
ARGV[3] concurrency
ARGV[4] ttl_ms       how long the entry stays live without news
Returns: {workers...}  the live workers. Entries past their expiry are removed (the hash
  holds one entry per worker process, so a listing that leaves them loses nothing).
workers...: 3 values each: name, in_flight, concurrency
]]
--- @include "keys"
--- @include "time"
--- @include "writes"
--- @include "workers"
local now = now_ms()
local entry = nil  -- this worker's new entry (nil: none)
if ARGV[1] ~= '' then
  -- The entry is dropped first, a write that frees: a full Redis still lists the worker (FIRST_WRITE_FREES).
  write('HDEL', K_WORKERS, ARGV[1])
  if (tonumber(ARGV[2]) or -1) >= 0 then
    entry = ARGV[2] .. ' ' .. ARGV[3] .. ' ' .. int_text(now + (tonumber(ARGV[4]) or 0))
    write('HSET', K_WORKERS, ARGV[1], entry)
  end
end
local out = live_workers(now, true, ARGV[1], entry)
commit()
return out
