--[[ stats: counts per state and the age of the oldest waiting task.
KEYS: the queue keys of lib.lua.
Returns: {now, waiting, delayed, active, completed, failed, canceled, oldest_ready_at,
  paused, max_active}
  oldest_ready_at: -1 = nothing waiting; paused: 0 | 1
]]
local now = now_ms()
local oldest = redis.call('ZRANGE', K_READY_SINCE, 0, 0, 'WITHSCORES')
return {now, redis.call('ZCARD', K_WAITING), redis.call('ZCARD', K_DELAYED),
  redis.call('ZCARD', K_ACTIVE), redis.call('ZCARD', K_COMPLETED), redis.call('ZCARD', K_FAILED),
  redis.call('ZCARD', K_CANCELED), tonumber(oldest[2] or '-1'), meta_num('paused', DEFAULTS.paused),
  meta_num('max_active', DEFAULTS.max_active)}
