--[[ fail: record a typed handler failure of an owned task; retry or fail for good.
KEYS: the queue keys of lib.lua.
ARGV[1] id  ARGV[2] token  ARGV[3] error (JSON object with at least "tag")
ARGV[4] retry_delay_ms  delay before the next attempt; -1 = this failure is not retryable
ARGV[5] default max_retries (task option, then meta max_retries, then this)
ARGV[6] retention_ms for failed records (meta retention_failed_ms wins; -1 = keep)
Returns: {status, handler_failure_count, retry_at}
  status: 1 = retry scheduled, 3 = failed for good, 2 = already settled by this token,
          0 = lease lost
]]
local id, token = ARGV[1], ARGV[2]
local now = now_ms()
local key = owned(id, token, now)
if not key then
  if settled_by(id, token) then return {2, 0, -1} end
  return {0, 0, -1}
end
local failures = redis.call('HINCRBY', key, 'handler_failure_count', 1)
local max_retries = task_option(key, 'max_retries', 'max_retries', ARGV[5])
local delay = tonumber(ARGV[4])
redis.call('ZREM', K_ACTIVE, id)
redis.call('HSET', key, 'error', ARGV[3], 'token', '', 'last_token', token)
if delay >= 0 and failures <= max_retries then
  local at = now + delay
  emit('failed', id, 'kind', 'handler', 'retry_at', at)
  if delay > 0 then
    enqueue_delayed(id, key, at)
  else
    enqueue_waiting(id, key, now)
    wake()
  end
  return {1, failures, at}
end
emit('failed', id, 'kind', 'handler', 'retry_at', -1)
settle(id, key, 'failed', K_FAILED, meta_num('retention_failed_ms', ARGV[6]), now)
return {3, failures, -1}
