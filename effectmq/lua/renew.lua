--[[ renew: extend the leases the caller still owns.
KEYS: the queue keys of lib.lua, then the task hash of each record's id, in order.
ARGV[1] lock_timeout_ms  the queue's meta lock_timeout_ms wins when set
ARGV[2...] leases...: 2 values each: id, token
Returns: {now, deadline, owned...}  owned: 1 (renewed) or 0 (lease lost) per lease
]]
local now = now_ms()
local deadline = now + meta_num('lock_timeout_ms', ARGV[1])
local out = {now, deadline}
local deadline_text = int_text(deadline)
for i = 2, #ARGV, 2 do
  local id = ARGV[i]
  local key = owned(id, ARGV[i + 1], now)
  if key then
    redis.call('HSET', key, 'lock_until', deadline_text)
    redis.call('ZADD', K_ACTIVE, 'XX', deadline_text, id)
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
