--[[ advance: record the outcome of a pass, one compare-and-set per schedule.
Called only after the ticks were offered, so a crash before it re-offers the same
task ids (harmless): the next pass decides from the same cursor at the same Redis time
(lib.lua's decided_at), so the same ticks with the same spans and counts. A scheduler
whose view is stale changes nothing.
KEYS: the scheduler keys of lib.lua, then the hash of each schedule in ARGV[1].
ARGV[1] JSON array of outcomes, one object per schedule (times are strings of ms):
  id, version   the schedule and the definition version the decision used
  expect        the cursor the decision started from
  cursor        the new cursor (the latest tick decided on)
  score         next due-zset score; absent: the expression never fires again
  last_tick, task   the last tick offered and its task id (absent: none offered)
  materialized, skipped, coalesced, backfilled   counter increments (absent: 0)
  error         present: the schedule could not run; recorded as last_error, the
                cursor is left alone and `score` is when to try again
Returns: one integer per outcome:
  1 = applied, 0 = schedule gone, -1 = definition changed meanwhile,
  -2 = cursor moved (another scheduler won), -3 = new cursor is after Redis time (the
  clock went back; the schedule is due again once Redis time reaches that cursor)
]]
local now = now_ms()
local results = {}
local seen = {}  -- a schedule twice in one call: the second finds the cursor moved (-2)
for i, o in ipairs(cjson.decode(ARGV[1])) do
  -- Numbers come as strings of ms; one that is not is refused here, before any write.
  if (o.score ~= nil and not tonumber(o.score)) or (not o.error and not tonumber(o.cursor)) then
    error('advance: the score or cursor of ' .. tostring(o.id) .. ' is not a number')
  end
  local key = schedule_key(o.id)
  local cur = redis.call('HMGET', key, 'version', 'cursor', 'last_error')
  local result = 1
  if seen[o.id] then
    result = -2
  elseif not cur[1] then
    result = 0
  elseif cur[1] ~= o.version then
    result = -1
  elseif o.error then
    write('HSET', key, 'last_error', tostring(o.error), 'last_error_at', now)
    write('ZADD', K_DUE, o.score, o.id)
    changed(o.id)
  elseif cur[2] ~= o.expect then
    result = -2
  elseif tonumber(o.cursor) > now then
    write('ZADD', K_DUE, o.cursor, o.id)
    result = -3
  else
    local fields = {'cursor', o.cursor, 'updated_at', now, 'decided_at', ''}  -- the next cursor's decision is new
    if o.last_tick then
      fields[#fields + 1] = 'last_tick'; fields[#fields + 1] = o.last_tick
      fields[#fields + 1] = 'last_task_id'; fields[#fields + 1] = o.task
    end
    if o.score then
      fields[#fields + 1] = 'next_tick'; fields[#fields + 1] = o.score
      write('ZADD', K_DUE, o.score, o.id)
    else
      write('HDEL', key, 'next_tick')
      write('ZREM', K_DUE, o.id) -- the expression never fires again
    end
    write('HSET', key, unpack(fields))
    if cur[3] then write('HDEL', key, 'last_error', 'last_error_at') end
    for _, counter in ipairs({'materialized', 'skipped', 'coalesced', 'backfilled'}) do
      local n = tonumber(o[counter])
      if n and n ~= 0 then write('HINCRBY', key, counter, string.format('%d', n)) end
    end
    changed(o.id)
  end
  seen[o.id] = true
  results[i] = result
end
commit()
return results
