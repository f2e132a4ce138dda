--[[ maintain: bounded sweeps; each one touches at most `batch` items.
KEYS: the queue keys of lib.lua.
ARGV[1] batch
ARGV[2] max_stalled_count  the default (task option, then meta max_stalled_count, then this)
ARGV[3] stalled_error      JSON, tag ~effectmq/Error/Stalled
ARGV[4] retention_ms       for failed records (meta retention_failed_ms wins; -1 = keep)
Returns: {recovered, stalled_failed, promoted, expired_records, expired_reservations, more}
  (expired_reservations also counts remembered settlements that ended)
  more = 1 when a sweep was cut short by its batch (call again soon).
]]
local now = now_ms()
local batch = tonumber(ARGV[1])
local more = 0
local recovered, dead = 0, 0

-- 1. Expired leases: the attempt stalled; count it and hand the task back or end it.
local expired = redis.call('ZRANGEBYSCORE', K_ACTIVE, '-inf', now, 'LIMIT', 0, batch)
if #expired == batch then more = 1 end
for _, id in ipairs(expired) do
  redis.call('ZREM', K_ACTIVE, id)
  local key = task_key(id)
  if redis.call('EXISTS', key) == 1 then
    local stalls = redis.call('HINCRBY', key, 'stalled_attempt_count', 1)
    local limit = task_option(key, 'max_stalled_count', 'max_stalled_count', ARGV[2])
    redis.call('HSET', key, 'token', '')
    if stalls > limit then
      redis.call('HSET', key, 'error', ARGV[3])
      emit('failed', id, 'kind', 'stall', 'retry_at', -1)
      settle(id, key, 'failed', K_FAILED, meta_num('retention_failed_ms', ARGV[4]), now)
      dead = dead + 1
    else
      emit('stalled', id, 'stalled_attempt_count', stalls)
      enqueue_waiting(id, key, now)
      recovered = recovered + 1
    end
  end
end
if recovered > 0 then wake() elseif dead > 0 then freed_slot() end

-- 2. Delayed tasks that are due.
local promoted = promote_due(now, batch)
if promoted == batch then more = 1 end
if promoted > 0 then wake() end

-- 3. Terminal records past their retention.
local forgotten = 0
for _, index in ipairs({K_COMPLETED, K_FAILED, K_CANCELED}) do
  local old = redis.call('ZRANGEBYSCORE', index, '-inf', now, 'LIMIT', 0, batch)
  if #old == batch then more = 1 end
  for _, id in ipairs(old) do
    redis.call('ZREM', index, id)
    forget(id, task_key(id), now)
    forgotten = forgotten + 1
  end
end

-- 4. Reserved ids whose dedup window ended.
local ended = redis.call('ZRANGEBYSCORE', K_DEDUP, '-inf', now, 'LIMIT', 0, batch)
if #ended == batch then more = 1 end
zrem_all(K_DEDUP, ended)

-- 5. Remembered settlements past their time.
local outcomes = redis.call('ZRANGEBYSCORE', K_SETTLED, '-inf', now, 'LIMIT', 0, batch)
if #outcomes == batch then more = 1 end
zrem_all(K_SETTLED, outcomes)

return {recovered, dead, promoted, forgotten, #ended, more}
