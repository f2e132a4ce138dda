--[[ progress: store the progress value of an owned task.
KEYS: the queue keys of keys.lua, then the task hash of ARGV's id.
ARGV[1] id
ARGV[2] token
ARGV[3] progress  JSON
Returns: stored  1 = stored, 0 = lease lost.
]]
--- @include "time"
--- @include "writes"
--- @include "events"
--- @include "leases"
local now = now_ms()
local key = owned(ARGV[1], ARGV[2], now)
if not key then return 0 end
write('HSET', key, 'progress', ARGV[3], 'progress_at', int_text(now))
emit('progress', ARGV[1], 'progress', ARGV[3])
commit()
return 1
