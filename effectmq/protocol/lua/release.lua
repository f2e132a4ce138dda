--[[ release: give an owned task back without counting a failure.
KEYS: the queue keys of keys.lua, then the task hash of ARGV's id, then the receipt key of
  each id in `receipts`.
ARGV[1] id
ARGV[2] token
ARGV[3] delay_ms  0 = ready now
ARGV[4] receipts  space-separated: the calls that carried a completion by this token
ARGV[5] ran  '0': its handler never started (a lease held ahead, handed back): no attempt,
  so the attempt number goes back and its history gets no entry; otherwise '1'
Last KEYS: group_ctl, backlog
  (only once the caller knows the queue counts its groups: group_caps.lua group_key_count)
Returns: outcome  (protocol.Outcome) 4 = released (now, or by this token before),
  1/2/3 = this token settled otherwise before, 0 = lease lost.
]]
--- @include "keys"
--- @include "time"
--- @include "writes"
--- @include "events"
--- @include "history"
--- @include "wake"
--- @include "indexes"
--- @include "receipts"
--- @include "outcomes"
--- @include "settle"
--- @include "leases"
--- @include "group_caps"
local group_keys = group_key_count()
if not group_keys then return group_keys_refused() end
local id, token = ARGV[1], ARGV[2]
local now = now_ms()
local key, lease = owned(id, token, now)
if not key then
  use_receipts('', ARGV[4], group_keys)
  return outcome_of(id, token)
end
local delay = tonumber(ARGV[3]) or 0
local ran = ARGV[5] ~= '0'
local attempt = not ran and tonumber(redis.call('HGET', key, 'attempt')) or 0  -- read only to give it back
write('ZREM', K_ACTIVE, id)  -- the first write frees (FIRST_WRITE_FREES)
if caps_from() then  -- its group's slot frees (group_caps.lua)
  use_caps(declared_last({'group_ctl', 'backlog'}))
  slot_freed(key, lease[1], token)
end
record_outcome(key, token, OUTCOME_RELEASED)
if ran then
  record_attempt(key, 'released', nil, now)
elseif attempt >= 1 then
  write('HSET', key, 'attempt', int_text(attempt - 1))
end
emit('released', id)
if delay > 0 then
  enqueue_delayed(id, key, now + delay)
  freed_slot()
else
  enqueue_waiting(id, key, now)
  wake({id})
end
return finish(OUTCOME_RELEASED)
