--[[ configure: write queue-level settings that scripts and workers read at run time.
KEYS: the queue keys of keys.lua.
ARGV[1...] settings...: 2 values each: field, value
  an empty value removes the field (back to the default).
  Fields: paused, max_active, rate_limit, max_retries, max_stalled_count, lock_timeout_ms,
  retention_completed_ms, retention_failed_ms, dedup_window_ms, events_maxlen, events_always,
  sensitive, retry; events_until (TaskQueue.want_events).
Returns: written  the number of fields written. Wakes idle workers (resume, a larger
  max_active).
]]
--- @include "call"
--- @include "keys"
--- @include "writes"
--- @include "meta"
--- @include "events"
--- @include "wake"
meta_value('paused')  -- the meta hash read, then changed here as it will be: emit reads the new settings
for i = 1, #ARGV, 2 do
  -- Dropped first, a write that frees: a full Redis can still be paused (lib.lua's FIRST_WRITE_FREES).
  write('HDEL', K_META, ARGV[i])
  if ARGV[i + 1] ~= '' then write('HSET', K_META, ARGV[i], ARGV[i + 1]) end
  call.meta[ARGV[i]] = ARGV[i + 1]
end
emit('configured', '')
wake()
commit()
return #ARGV / 2
