--[[ fail: record a typed handler failure of an owned task; retry or fail for good.
KEYS: the queue keys of keys.lua, then the task hash of ARGV's id, then the receipt key of
  each id in `receipts`.
ARGV[1] id
ARGV[2] token
ARGV[3] error           JSON object with at least "tag" (one that cannot be stored is
  replaced by a placeholder saying why: the failure still counts)
ARGV[4] retry_delay_ms  delay before the next attempt; -1 = this failure is not retryable
ARGV[5] max_retries     the default (task option, then meta max_retries, then this)
ARGV[6] retention_ms    for failed records (meta retention_failed_ms wins; -1 = keep)
ARGV[7] receipts        space-separated: the calls that carried a completion by this token
Last KEYS: group_ctl, backlog
  (only once the caller knows the queue counts its groups: group_caps.lua group_key_count)
Returns: {outcome, handler_failure_count, retry_at}
  outcome (protocol.Outcome): 2 = retry scheduled, 3 = failed for good, 0 = lease lost;
  a token that settled before (a resent acknowledgement) gets its outcome again, with
  handler_failure_count -1.
]]
--- @include "keys"
--- @include "time"
--- @include "writes"
--- @include "meta"
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
  use_receipts('', ARGV[7], group_keys)
  return {outcome_of(id, token), -1, -1}
end
write('ZREM', K_ACTIVE, id)  -- the first write frees (FIRST_WRITE_FREES)
if caps_from() then  -- its group's slot frees (group_caps.lua)
  use_caps(declared_last({'group_ctl', 'backlog'}))
  slot_freed(key, lease[1], token)
end
local failures = (tonumber(redis.call('HGET', key, 'handler_failure_count')) or 0) + 1
local max_retries = task_option(key, 'max_retries', 'max_retries', ARGV[5])
local delay = tonumber(ARGV[4]) or -1
local error_json = stored_error(ARGV[3], 'handler')
write('HSET', key, 'handler_failure_count', int_text(failures), 'error', error_json)
record_attempt(key, 'failed', error_json, now)
if delay >= 0 and failures <= max_retries then
  local at = now + delay
  record_outcome(key, token, OUTCOME_RETRY)
  emit('failed', id, 'kind', 'handler', 'retry_at', int_text(at))
  if delay > 0 then
    enqueue_delayed(id, key, at)
    freed_slot()
  else
    enqueue_waiting(id, key, now)
    wake({id})
  end
  return finish({OUTCOME_RETRY, failures, at})
end
record_outcome(key, token, OUTCOME_FAILED)
emit('failed', id, 'kind', 'handler', 'retry_at', -1)
settle(id, key, 'failed', K_FAILED, meta_num('retention_failed_ms', ARGV[6]), now, nil, lease, '3')  -- '3': OUTCOME_FAILED as text
freed_slot()
return finish({OUTCOME_FAILED, failures, -1})
