--[[ cancel: end a task that has not settled; an active attempt loses its lease.
KEYS: the queue keys of keys.lua, then the task hash of ARGV's id.
ARGV[1] id
ARGV[2] error         JSON, tag ~effectmq/Error/Canceled
ARGV[3] retention_ms  for canceled records (meta retention_failed_ms wins; -1 = keep)
ARGV[4] request       random per call ('' = none): the same call sent again (its reply
  lost) answers as the first send did
Last KEYS: group_ctl, backlog
  (only once the caller knows the queue counts its groups: group_caps.lua group_key_count)
Returns: previous_state  the state the task was in ("" when unknown); only waiting,
  delayed and active tasks are canceled (a parked task is waiting: group_caps.lua).
]]
--- @include "keys"
--- @include "time"
--- @include "writes"
--- @include "meta"
--- @include "events"
--- @include "history"
--- @include "wake"
--- @include "indexes"
--- @include "outcomes"
--- @include "settle"
--- @include "group_caps"
if not group_key_count() then return group_keys_refused() end
local id, request = ARGV[1], ARGV[4] or ''
local key = task_key(id)
local f = redis.call('HMGET', key, 'state', 'canceled_by', 'canceled_was', 'group', 'token', 'parked')
local state = f[1]
local now = now_ms()
if request ~= '' and state == 'canceled' and f[2] == request then return f[3] end  -- a resend
if not state then
  if request ~= '' then  -- a resend after the record was deleted at once (retention 0)?
    for _, was in ipairs({'waiting', 'delayed', 'active'}) do
      local until_ms = redis.call('ZSCORE', K_SETTLED, 'c:' .. request .. ':' .. was)
      if until_ms and tonumber(until_ms) >= now then return was end
    end
  end
  return ''
end
if state ~= 'waiting' and state ~= 'delayed' and state ~= 'active' then return state end
local retention = meta_num('retention_failed_ms', ARGV[3])
local caps = caps_from() and use_caps(declared_last({'group_ctl', 'backlog'}))
drop_from_indexes(id, state)
if caps and state == 'waiting' and f[6] and f[4] and not redis.call('ZSCORE', K_WAITING, id) then
  write('ZREM', caps.backlog, parked_member(f[4], tonumber(f[6]) or 0, id))  -- parked: not counted as waiting
elseif state == 'waiting' then
  group_left(f[4])
end
local fields = {'error', stored_error(ARGV[2], 'canceled')}
if request ~= '' then
  if retention == 0 then  -- the record goes now: the answer is remembered as a settlement is
    zadd_later(K_SETTLED, int_text(now + SETTLED_SLACK_MS), 'c:' .. request .. ':' .. state)
  else
    fields[3], fields[4], fields[5], fields[6] = 'canceled_by', request, 'canceled_was', state
  end
end
write('HSET', key, unpack(fields))
emit('canceled', id, 'was', state)
settle(id, key, 'canceled', K_CANCELED, retention, now)
if state == 'active' then
  freed_slot()
  slot_freed(key, nil, f[5], f[4] or '')
end
return finish(state)
