--[[ complete: settle owned tasks as completed with their results (one or many per call).
KEYS: the queue keys of lib.lua.
ARGV[1] retention_ms for completed records (meta retention_completed_ms wins; -1 = keep)
then triples: id, token, result (JSON)
Returns: one code per task: 1 = completed, 2 = already completed by this token (a retried
acknowledgement), 0 = lease lost (nothing changed).
]]
local now = now_ms()
local retention = meta_num('retention_completed_ms', ARGV[1])
local out = {}
for i = 2, #ARGV, 3 do
  local id, token = ARGV[i], ARGV[i + 1]
  local key = owned(id, token, now)
  if key then
    redis.call('ZREM', K_ACTIVE, id)
    redis.call('HSET', key, 'result', ARGV[i + 2], 'last_token', token)
    emit('completed', id)
    settle(id, key, 'completed', K_COMPLETED, retention, now)
    out[#out + 1] = 1
  elseif settled_by(id, token) and redis.call('HGET', task_key(id), 'state') == 'completed' then
    out[#out + 1] = 2
  else
    out[#out + 1] = 0
  end
end
return out
