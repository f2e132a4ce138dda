--[[ cancel: end a task that has not settled; an active attempt loses its lease.
KEYS: the queue keys of keys.lua, then the task hash of ARGV's id.
ARGV[1] id
ARGV[2] error         JSON, tag ~effectmq/Error/Canceled
ARGV[3] retention_ms  for canceled records (meta retention_failed_ms wins; -1 = keep)
Returns: previous_state  the state the task was in ("" when unknown); only waiting,
  delayed and active tasks are canceled.
]]
--- @include "keys"
--- @include "time"
--- @include "writes"
--- @include "meta"
--- @include "events"
--- @include "history"
--- @include "wake"
--- @include "indexes"
--- @include "settle"
local id = ARGV[1]
local key = task_key(id)
local state = redis.call('HGET', key, 'state')
if not state then return '' end
if state ~= 'waiting' and state ~= 'delayed' and state ~= 'active' then return state end
local now = now_ms()
drop_from_indexes(id, state)
write('HSET', key, 'error', stored_error(ARGV[2], 'canceled'))
emit('canceled', id, 'was', state)
settle(id, key, 'canceled', K_CANCELED, meta_num('retention_failed_ms', ARGV[3]), now)
if state == 'active' then freed_slot() end
return finish(state)
