--[[ configure: write queue-level settings that scripts and workers read at run time.
KEYS: the queue keys of keys.lua.
ARGV[1...] settings...: 2 values each: field, value
  an empty value removes the field (back to the default).
  Fields: paused, max_active, rate_limit, max_retries, max_stalled_count, lock_timeout_ms,
  retention_completed_ms, retention_failed_ms, dedup_window_ms, events_maxlen, events_always,
  sensitive, retry, group_max_active, group_rate_limit; events_until (TaskQueue.want_events).
  A group_max_active above 0 or a group_rate_limit on a queue that counts no group's
  attempts yet starts the counting (meta group_caps: group_caps.lua).
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
  local counts = (ARGV[i] == 'group_max_active' and (tonumber(ARGV[i + 1]) or 0) > 0) or
    (ARGV[i] == 'group_rate_limit' and ARGV[i + 1] ~= '')
  if counts and meta_value('group_caps') == nil then
    local seq = redis.call('GET', K_SEQ) or '0'
    write('HSET', K_META, 'group_caps', seq)
    call.meta.group_caps = seq
  end
end
emit('configured', '')
wake()
commit()
return #ARGV / 2
