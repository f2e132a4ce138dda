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
local done = {}  -- ids completed by this call
for i = 2, #ARGV, 3 do
  local id, token = ARGV[i], ARGV[i + 1]
  local key, st = owned(id, token, now)
  if key then
    done[#done + 1] = id
    emit('completed', id)
    settle(id, key, 'completed', K_COMPLETED, retention, now,
      {'result', ARGV[i + 2], 'last_token', token, 'last_outcome', OUTCOME_COMPLETED},
      {st[4], token, OUTCOME_COMPLETED, st[3]})
    out[#out + 1] = OUTCOME_COMPLETED
  else
    out[#out + 1] = outcome_of(id, token)
  end
end
if #done > 0 then
  zrem_all(K_ACTIVE, done)
  freed_slot()
end
return finish(out)
