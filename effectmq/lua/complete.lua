--[[ complete: settle an owned task as completed with its result.
KEYS: the queue keys of lib.lua.
ARGV[1] id  ARGV[2] token  ARGV[3] result (JSON)
ARGV[4] retention_ms for completed records (meta retention_completed_ms wins; -1 = keep)
Returns: 1 = completed, 2 = already completed by this token (retried ack), 0 = lease lost.
]]
local id, token = ARGV[1], ARGV[2]
local now = now_ms()
local key = owned(id, token, now)
if not key then
  if settled_by(id, token) and redis.call('HGET', task_key(id), 'state') == 'completed' then return 2 end
  return 0
end
redis.call('ZREM', K_ACTIVE, id)
redis.call('HSET', key, 'result', ARGV[3], 'last_token', token)
emit('completed', id)
settle(id, key, 'completed', K_COMPLETED, meta_num('retention_completed_ms', ARGV[4]), now)
return 1
