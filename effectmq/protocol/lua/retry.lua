--[[ retry: put a failed or canceled task back to waiting with fresh failure counters.
KEYS: the queue keys of keys.lua, then the task hash of ARGV's id.
ARGV[1] id
ARGV[2] request  random per call ('' = none): the same call sent again (its reply lost)
  answers as the first send did
Returns: previous_state  the state the task was in ("" when unknown); only failed and
  canceled tasks are retried.
]]
--- @include "keys"
--- @include "time"
--- @include "writes"
--- @include "events"
--- @include "wake"
--- @include "indexes"
local id, request = ARGV[1], ARGV[2] or ''
local key = task_key(id)
local f = redis.call('HMGET', key, 'state', 'retried_by', 'retried_was')
local state = f[1]
if not state then return '' end
if request ~= '' and f[2] == request then return f[3] end  -- a resend: whatever became of it since
if state ~= 'failed' and state ~= 'canceled' then return state end
local now = now_ms()
drop_from_indexes(id, state)
write('HSET', key, 'handler_failure_count', '0', 'stalled_attempt_count', '0', 'finished_at', '')
write('HDEL', key, 'error', 'canceled_by', 'canceled_was')
if request ~= '' then write('HSET', key, 'retried_by', request, 'retried_was', state) end
enqueue_waiting(id, key, now)
emit('retried', id, 'was', state)
wake({id})
commit()
return state
