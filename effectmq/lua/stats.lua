--[[ stats: counts per state and the age of the oldest waiting task.
KEYS: the queue keys of lib.lua.
Returns: {now, waiting, delayed, active, completed, failed, canceled, oldest_ready_at (-1),
          paused (0|1), max_active}
]]
local now = now_ms()
local oldest = redis.call('ZRANGE', K_READY_SINCE, 0, 0, 'WITHSCORES')
return {now, redis.call('ZCARD', K_WAITING), redis.call('ZCARD', K_DELAYED),
  redis.call('ZCARD', K_ACTIVE), redis.call('ZCARD', K_COMPLETED), redis.call('ZCARD', K_FAILED),
  redis.call('ZCARD', K_CANCELED), tonumber(oldest[2] or '-1'), meta_num('paused', 0),
  meta_num('max_active', 0)}
