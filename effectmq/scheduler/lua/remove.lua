--[[ remove: delete a schedule (tasks it already materialized are not touched).
KEYS: the scheduler keys of lib.lua, then the schedule's hash.
ARGV[1] id
Returns: 1 = removed, 0 = no such schedule.
]]
local id = ARGV[1]
local key = schedule_key(id)
local existed = redis.call('EXISTS', key)
forget(id)
write('ZREM', K_INDEX, id)
write('DEL', key)
commit()
return existed
