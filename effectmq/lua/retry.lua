--[[ retry: put a failed or canceled task back to waiting with fresh failure counters.
KEYS: the queue keys of keys.lua, then the task hash of ARGV's id.
ARGV[1] id
Returns: previous_state  the state the task was in ("" when unknown); only failed and
  canceled tasks are retried.
]]
--- @include "keys"
--- @include "time"
--- @include "writes"
--- @include "events"
--- @include "wake"
--- @include "indexes"
local id = ARGV[1]
local key = task_key(id)
local state = redis.call('HGET', key, 'state')
if not state then return '' end
if state ~= 'failed' and state ~= 'canceled' then return state end
local now = now_ms()
drop_from_indexes(id, state)
write('HSET', key, 'handler_failure_count', '0', 'stalled_attempt_count', '0', 'finished_at', '')
write('HDEL', key, 'error')
enqueue_waiting(id, key, now)
emit('retried', id, 'was', state)
wake({id})
commit()
return state
