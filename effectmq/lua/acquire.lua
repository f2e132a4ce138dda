--[[ acquire: lease up to `count` ready tasks, each under a new token.
KEYS: the queue keys of lib.lua.
ARGV[1] count            how many tasks the caller can run now
ARGV[2] lock_timeout_ms  lease length (the queue's meta lock_timeout_ms wins when set)
ARGV[3] token_prefix     random per-process prefix; the token is prefix..":"..seq
ARGV[4] promote_batch    at most this many due delayed tasks are promoted first
Returns: {now, deadline, next_due, status, leases...}
  next_due: -1 = no delayed task
  status: "ok" | "paused" | "limited" (max_active reached)
leases...: 10 values each: id, token, attempt, name, payload, handler_failure_count,
  stalled_attempt_count, max_retries, options, priority
]]
local now = now_ms()
local count = tonumber(ARGV[1])
local lock_timeout = meta_num('lock_timeout_ms', ARGV[2])
local deadline = now + lock_timeout
promote_due(now, tonumber(ARGV[4]))
local out = {now, deadline, 0, 'ok'}
if meta_num('paused', DEFAULTS.paused) == 1 then
  out[3] = next_due()
  out[4] = 'paused'
  return out
end
local max_active = meta_num('max_active', DEFAULTS.max_active)
if max_active > 0 then
  local room = max_active - redis.call('ZCARD', K_ACTIVE)
  if room < count then count = room end
  if count <= 0 then
    out[3] = next_due()
    out[4] = 'limited'
    return out
  end
end
local popped = redis.call('ZPOPMIN', K_WAITING, count)
for i = 1, #popped, 2 do
  local id = popped[i]
  local key = task_key(id)
  redis.call('ZREM', K_READY_SINCE, id)
  if redis.call('EXISTS', key) == 1 then
    local attempt = redis.call('HINCRBY', key, 'attempt', 1)
    local token = ARGV[3] .. ':' .. redis.call('INCR', K_SEQ)
    redis.call('HSET', key, 'state', 'active', 'token', token, 'lock_until', deadline, 'started_at', now)
    redis.call('ZADD', K_ACTIVE, deadline, id)
    local f = redis.call('HMGET', key, 'name', 'payload', 'handler_failure_count',
      'stalled_attempt_count', 'max_retries', 'options', 'priority')
    out[#out + 1] = id
    out[#out + 1] = token
    out[#out + 1] = attempt
    for j = 1, 7 do out[#out + 1] = f[j] end
    emit('active', id, 'attempt', attempt)
  end
end
out[3] = next_due()
return out
