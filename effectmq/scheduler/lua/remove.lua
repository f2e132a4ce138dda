--[[ remove: delete a schedule (tasks it already materialized are not touched).
KEYS: the scheduler keys of lib.lua.
ARGV[1] id
Returns: 1 = removed, 0 = no such schedule.
]]
local id = ARGV[1]
redis.call('ZREM', K_DUE, id)
redis.call('ZREM', K_INDEX, id)
return redis.call('DEL', schedule_key(id))
