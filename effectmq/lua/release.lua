--[[ release: give an owned task back without counting a failure.
KEYS: the queue keys of lib.lua.
ARGV[1] id  ARGV[2] token  ARGV[3] delay_ms (0 = ready now)
Returns: 1 = released, 2 = already released by this token, 0 = lease lost.
]]
local id, token = ARGV[1], ARGV[2]
local now = now_ms()
local key = owned(id, token, now)
if not key then
  if settled_by(id, token) then return 2 end
  return 0
end
local delay = tonumber(ARGV[3])
redis.call('ZREM', K_ACTIVE, id)
redis.call('HSET', key, 'token', '', 'last_token', token)
emit('released', id)
if delay > 0 then
  enqueue_delayed(id, key, now + delay)
else
  enqueue_waiting(id, key, now)
  wake()
end
return 1
