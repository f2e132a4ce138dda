--[[ live_workers: list the live workers of the queue, writing nothing (a read-only replica
runs it; workers.lua drops the entries past their expiry).
KEYS: the queue keys of keys.lua.
Returns: {workers...}  the live workers
workers...: 3 values each: name, in_flight, concurrency
]]
--- @include "time"
--- @include "workers"
return live_workers(now_ms(), false)
