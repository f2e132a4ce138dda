--[[ groups.lua: task groups: fair turns between groups in the waiting index, and their counts.

A task may carry a group (a tenant, a customer). Groups share the waiting index by
start-time fair queuing: a grouped task's sequence number (its score within its priority
band, keys.lua) is its group's virtual time instead of the counter's next number:
  max(the group's last + 1, V + 1)
where V is the sequence number of the head of its band (the counter's last number when the
band is empty). A group that offers 100,000 tasks takes V+1..V+100,000; one that offers 20
a moment later takes V'+1..V'+20, next to the head: from there the two alternate. A group
that had nothing waiting gets no credit for it (V moved on). Acquire needs no change: it
leases in score order as before. Two groups' n-th tasks may share a score; Redis orders
them by id.
While any grouped task waits, tasks without a group are the group '' (one more group, not
counted in K_GROUPS); else they take the counter's next number as before. A queue that
never had a grouped task (meta `grouped` unset) does not even look whether any waits. The counter is kept at least
as high as every number handed out here, so that a task taking it comes after them all.
Tasks entering waiting before the last id an acquire reply named (K_PEEKED) move that mark
back to just before them, so that the next replies name them (acquire.lua names the ids
after the mark, and holds those before it as named already).
Keys (keys.lua): K_GROUPS zset group -> its waiting tasks (a member only while > 0);
K_GROUP_CLOCK hash group -> the last sequence number a task of it took (removed with its
K_GROUPS member: an idle group starts again from V).
]]
--- @include "call"
--- @include "keys"
--- @include "writes"
--- @include "time"
--- @include "wake"
--- @include "meta"

-- The score of the last id an acquire reply named (K_PEEKED), read once; -inf: none.
local function group_mark(g)
  if g.mark == nil then
    local named = redis.call('GET', K_PEEKED)
    g.mark = named and tonumber(string.match(named, '^%S+ (%S+)$') or named) or -math.huge
  end
  return g.mark
end

-- Where the mark moves when tasks entered before it: just before the first of them. Acquire
-- holds a head named when it is no later than the mark, by score and by sequence number
-- (acquire.lua): in the mark's band, moving it back names nothing new; into another band,
-- the mark goes before that band's head too, which was perhaps named to nobody.
local function moved_mark(g)
  local band = math.floor(g.lowest / PRIORITY_SPAN) * PRIORITY_SPAN
  if math.floor(g.mark / PRIORITY_SPAN) * PRIORITY_SPAN == band then return g.lowest - 1 end
  local head = redis.call('ZRANGE', K_WAITING, int_text(band), int_text(g.lowest), 'BYSCORE', 'LIMIT', '0', '1',
    'WITHSCORES')
  return math.min(g.lowest, tonumber(head[2]) or g.lowest) - 1
end

-- The gathered changes, written once at the call's end (commit_writes calls flush first:
-- its reads come before every write).
local function group_changes()
  local g = call.groups
  if g == nil then
    g = {delta = {}, last = {}, order = {}, head = {}}
    g.flush = function()
      for _, group in ipairs(g.order) do
        local remove = false
        if group ~= '' then
          local count = (tonumber(redis.call('ZSCORE', K_GROUPS, group)) or 0) + g.delta[group]
          remove = count <= 0  -- below 0 only after a version that did not count took some
          if remove then write('ZREM', K_GROUPS, group) else write('ZADD', K_GROUPS, int_text(count), group) end
        end
        if remove then
          write('HDEL', K_GROUP_CLOCK, group)
        elseif g.last[group] then
          write('HSET', K_GROUP_CLOCK, group, int_text(g.last[group]))
        end
      end
      if g.lowest and g.lowest <= group_mark(g) then write('SET', K_PEEKED, 'groups ' .. int_text(moved_mark(g))) end
      call.groups = nil
    end
    call.groups = g
  end
  return g
end

local function touch(g, group)
  if g.delta[group] == nil then
    g.delta[group] = 0
    g.order[#g.order + 1] = group
  end
end

-- Does a task of `group` (false, nil or '': none) count? Then +1 or -1 waiting.
local function group_counted(group, by)
  if group and group ~= '' then
    local g = group_changes()
    touch(g, group)
    g.delta[group] = g.delta[group] + by
  end
end
local function group_entered(group)
  group_counted(group, 1)
end
local function group_left(group)
  group_counted(group, -1)
end
-- A parked task of `group` back in waiting at its old `score` (group_caps.lua): counted, and
-- the mark moves back before it, as before any task that enters ahead of the ids named.
local function group_returned(group, score)
  group_counted(group, 1)
  local g = call.groups
  if g.lowest == nil or score < g.lowest then g.lowest = score end
end

-- Does any grouped task wait (or enter waiting in this call)? A queue that never had one
-- (meta `grouped`, set by its first grouped task) does not look: its scripts read the meta
-- hash anyway, and the look was most of what groups cost an offer of plain tasks.
local function groups_waiting()
  if call.groups_waiting == nil then
    call.groups_waiting = meta_value('grouped') == 1 and redis.call('EXISTS', K_GROUPS) == 1
  end
  return call.groups_waiting
end

-- The sequence number of a task of `group` (false, nil or '': none) entering waiting in
-- priority band `prio`.
local function waiting_seq(group, prio)
  if not group or group == '' then
    if not groups_waiting() then return take_seq(1) end
    group = ''
  else
    if meta_value('grouped') ~= 1 then  -- this queue's first grouped task: from now on it looks
      write('HSET', K_META, 'grouped', '1')
      call.meta.grouped = '1'
    end
    call.groups_waiting = true
  end
  local g = group_changes()
  local v = g.head[prio]
  if v == nil then  -- the band's head as the call found it
    local low = (-prio) * PRIORITY_SPAN
    local head = redis.call('ZRANGE', K_WAITING, int_text(low), '(' .. int_text(low + PRIORITY_SPAN), 'BYSCORE',
      'LIMIT', '0', '1', 'WITHSCORES')
    if head[2] then v = tonumber(head[2]) - low else v = take_seq(0) - 1 end
    g.head[prio] = v
  end
  local last = g.last[group]
  if last == nil then last = tonumber(redis.call('HGET', K_GROUP_CLOCK, group)) or 0 end
  local seq = math.max(last + 1, v + 1)
  touch(g, group)
  g.last[group] = seq
  local next_seq = take_seq(0)
  if seq >= next_seq then take_seq(seq - next_seq + 1) end
  local score = (-prio) * PRIORITY_SPAN + seq
  if g.lowest == nil or score < g.lowest then g.lowest = score end
  return seq
end

-- Wake the workers about tasks this call put before ids already named (`ids`, `scores`:
-- the tasks it put into waiting): busy workers hold names after them, so the message
-- names the first FRONT_WAKE_IDS of them as ids to declare first ({"f": [...]}, engine.py
-- WakeSignal and MAX_FIRST), in score order. Else, or none: as wake(ids).
local FRONT_WAKE_IDS = 64
local function wake_groups(ids, scores)
  local g = call.groups
  local front = {}
  if g and g.lowest and g.lowest <= group_mark(g) then
    for i, id in ipairs(ids) do
      if scores[i] <= g.mark then front[#front + 1] = i end
    end
  end
  if #front == 0 then return wake(ids) end
  if #front > 1 then  -- the lowest scores first: a task offered later in its group comes later
    table.sort(front, function(a, b) return scores[a] < scores[b] end)
  end
  local named = {}
  for n = 1, math.min(#front, FRONT_WAKE_IDS) do named[n] = ids[front[n]] end
  hint('PUBLISH', BASE .. 'wake', cjson.encode({f = named}))
end
