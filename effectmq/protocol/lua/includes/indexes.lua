-- indexes.lua: the state indexes: waiting (priority, FIFO), delayed, and index writes gathered per call.
--- @include "call"
--- @include "keys"
--- @include "writes"
--- @include "time"
--- @include "groups"

-- Put a task into the waiting index (its priority band, FIFO by seq; its group's turn).
local function enqueue_waiting(id, key, now)
  local f = redis.call('HMGET', key, 'priority', 'group')
  local prio = tonumber(f[1] or '0') or 0
  local score = (-prio) * PRIORITY_SPAN + waiting_seq(f[2], prio)
  group_entered(f[2])
  write('ZADD', K_WAITING, int_text(score), id)
  write('HSET', key, 'state', 'waiting', 'ready_at', int_text(now))
  return score
end

local function enqueue_delayed(id, key, due)
  write('ZADD', K_DELAYED, int_text(due), id)
  write('HSET', key, 'state', 'delayed', 'ready_at', int_text(due))
end
local function zadd_later(index, score, member)
  local list = call.adds[index]
  if list == nil then
    list = {}
    call.adds[index] = list
    call.add_order[#call.add_order + 1] = index
  end
  list[#list + 1] = score
  list[#list + 1] = member
end
local function flush_adds()
  for _, index in ipairs(call.add_order) do
    local list = call.adds[index]
    if #list <= 2000 then  -- one command: the list becomes it (no copy)
      table.insert(list, 1, index)
      table.insert(list, 1, 'ZADD')
      write_command(list)
    else
      for i = 1, #list, 2000 do
        write('ZADD', index, unpack(list, i, math.min(i + 1999, #list)))
      end
    end
  end
  call.adds, call.add_order = {}, {}
end

-- ZREM many members (from the `from`th, default the first) without overflowing Lua's
-- stack with unpack().
local function zrem_all(index, members, from, to)
  to = to or #members
  for i = from or 1, to, 1000 do
    write('ZREM', index, unpack(members, i, math.min(i + 999, to)))
  end
end

local function drop_from_indexes(id, state)
  local index = ({waiting = K_WAITING, delayed = K_DELAYED, active = K_ACTIVE, completed = K_COMPLETED,
    failed = K_FAILED, canceled = K_CANCELED})[state]
  if index then write('ZREM', index, id) end
end

-- Move a declared delayed task into waiting if it is due: its waiting score (true when its
-- record is gone), false when it is not due.
local function promote_if_due(id, now)
  local due = redis.call('ZSCORE', K_DELAYED, id)
  if not due or tonumber(due) > now then return false end
  write('ZREM', K_DELAYED, id)
  call.promoted = call.promoted + 1
  local key = task_key(id)
  if redis.call('EXISTS', key) == 1 then
    return enqueue_waiting(id, key, now)
  end
  return true
end

local function next_due()
  local first = redis.call('ZRANGE', K_DELAYED, '0', '0', 'WITHSCORES')
  if not first[2] then return -1 end
  local at = tonumber(first[2])
  if call.promoted == 0 or at > now_ms() then return at end
  -- This call promoted some of the due ones (their removal is still queued): the next
  -- due is now when others are due too, else the first one after now.
  if redis.call('ZCOUNT', K_DELAYED, '-inf', now_text()) > call.promoted then return at end
  first = redis.call('ZRANGE', K_DELAYED, '(' .. now_text(), '+inf', 'BYSCORE', 'LIMIT', '0', '1', 'WITHSCORES')
  if first[2] then return tonumber(first[2]) end
  return -1
end
