--[[ complete: settle owned tasks as completed with their results (one or many per call).
KEYS: the queue keys of lib.lua, then the task hash of each record's id, in order.
ARGV[1] retention_ms  for completed records (meta retention_completed_ms wins; -1 = keep)
ARGV[2...] completions...: 3 values each: id, token, result
  result: JSON
Returns: {outcomes...}  one per completion (protocol.Outcome): 1 = completed (now, or by
  this token before: a resent acknowledgement), 2/3/4 = this token settled otherwise
  before (retry, failed, released), 0 = lease lost (nothing changed).
]]
local now = now_ms()
local retention = meta_num('retention_completed_ms', ARGV[1])
local out = {}
local freed = false
for i = 2, #ARGV, 3 do
  local id, token = ARGV[i], ARGV[i + 1]
  local key = owned(id, token, now)
  if key then
    redis.call('ZREM', K_ACTIVE, id)
    redis.call('HSET', key, 'result', ARGV[i + 2])
    record_outcome(key, token, OUTCOME_COMPLETED)
    emit('completed', id)
    settle(id, key, 'completed', K_COMPLETED, retention, now)
    out[#out + 1] = OUTCOME_COMPLETED
    freed = true
  else
    out[#out + 1] = outcome_of(id, token)
  end
end
if freed then freed_slot() end
return out
