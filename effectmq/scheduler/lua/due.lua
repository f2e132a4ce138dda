--[[ due: the schedules whose next fire time has come, by Redis time.
KEYS: the scheduler keys of lib.lua.
ARGV[1] batch: at most this many schedules
ARGV[2] upto (optional): only schedules due at or before this time (ms), when it is
        before now: a pass taken in slices reads what was due when it began, and ends
Returns: {now, next, id1, spec1, version1, cursor1, id2, ...}
  now  = Redis time (ms) the caller must decide with
  next = the earliest fire time after min(now, upto) (ms), -1 if none
Costs O(log n + batch): schedules that are not due are never read. A hash written
without version or cursor (by hand) gets version 1 and a cursor of now.
]]
local now = now_ms()
local upto = math.min(now, tonumber(ARGV[2]) or now)
local ids = redis.call('ZRANGEBYSCORE', K_DUE, '-inf', upto, 'LIMIT', 0, tonumber(ARGV[1]))
local upcoming = redis.call('ZRANGEBYSCORE', K_DUE, '(' .. upto, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
local out = {now, upcoming[2] or -1}
for _, id in ipairs(ids) do
  local key = schedule_key(id)
  local row = redis.call('HMGET', key, 'spec', 'version', 'cursor')
  if row[1] and not (row[2] and row[3]) then
    redis.call('HSETNX', key, 'version', 1)
    redis.call('HSETNX', key, 'cursor', now)
    row = redis.call('HMGET', key, 'spec', 'version', 'cursor')
  end
  if row[1] then
    out[#out + 1] = id
    out[#out + 1] = row[1]
    out[#out + 1] = row[2]
    out[#out + 1] = row[3]
  else
    redis.call('ZREM', K_DUE, id) -- its hash is gone: nothing to schedule
  end
end
return out
