--[[ group_caps.lua: a cap per group on attempts running at once, and a group's pause.

Nothing here runs until a queue has a cap or a pause: meta `group_caps` (set by the first
configure_group that caps or pauses, or by a queue-wide group_max_active) holds the
sequence number the counting started from. A lease whose token's sequence number
(prefix:seq) is after it was counted against its group when acquire started it; one from
before was not, and its end frees nothing (the attempts already running when the first cap
came are not counted: they finish as they were).
Last KEYS of the scripts that start or end attempts (acquire, complete, fail, release,
cancel, maintain, reclaim) and of stats, once the caller knows that the queue counts (a
script of a queue that counts refuses a call without them before anything: group_key_count;
the client then sends it again with them, and from then on), and of configure_group:
  group_ctl  hash: "a:"..group = its counted attempts running now (removed at 0),
             "m:"..group = its own cap (0: none; absent: the queue's group_max_active),
             "p:"..group = "1" while it is paused,
             "r:"..group = its own rate limit "<tasks> <period_ms>" ("0": none; absent:
             the queue's group_rate_limit)
  backlog    zset of parked tasks, every score 0, member = group.."\0"..position..id:
             position = the task's waiting score plus 2^51 in 16 digits, so that a group's
             parked tasks are a lex range in waiting order (a group name has no control
             character: checked by the client)
Acquire parks a task it picked whose group is paused or at its cap (out of waiting, into
backlog; its hash keeps the score in `parked` for cancel) and goes on to its next pick, so a
capped group never holds up the head. A parked task is still in state waiting. Every way an
attempt ends hands the group's first parked tasks back to waiting, at their old scores (the
turns they lost), while the group has room; so do resume_group and a cap raised or removed
(configure_group). A task handed back is not written (its hash is not declared): its
`parked` field stays, and a task in the waiting index is not parked, whatever it says.
A group's rate limit (at most `tasks` starts in any window of `period_ms`, by Redis time, as
rate.lua's for a queue) parks its picks too, once the window holds `tasks` of its starts.
Acquire and configure_group alone declare its two keys (between starts and group_ctl):
  group_starts  zset of the rate-limited groups' starts, every score 0, member =
                group.."\0"..start ms in 15 digits.."\0"..lease seq: a group's starts are a
                lex range in time order (counted with ZLEXCOUNT, its old ones trimmed when
                it starts again; the key expires one span after the last start)
  group_due     zset group -> the Redis time (ms) its rate limit may allow a start again,
                while it has tasks parked by it
Acquire hands the first parked tasks of a few due groups back (GROUPS_DUE a call), as many
as the window allows, and tells its caller when the next group is due (next_due), so an
idle worker sleeps until then. Other scripts cannot see a window: an attempt's end hands
back nothing of a rate-limited group without a cap (group_due does).
]]
--- @include "call"
--- @include "keys"
--- @include "writes"
--- @include "time"
--- @include "meta"
--- @include "extras"
--- @include "groups"
--- @include "rate"

-- The sequence number from which leases count against their group; nil: no cap or pause yet.
local function caps_from()
  return meta_value('group_caps')
end

-- How many group keys the caller declared last: 2, or 0 from a caller that does not know
-- the queue counts its groups (declaring them costs every call); nil when the queue counts
-- and they are missing: the script returns group_keys_refused() before anything else.
local function group_key_count()
  local last = KEYS[#KEYS]  -- BASE..'backlog', read without making a string: this runs on every call
  if #last == #BASE + 7 and string.find(last, 'backlog', #BASE + 1, true) then return 2 end
  if caps_from() then return nil end
  return 0
end
local function group_keys_refused()
  return redis.error_reply('GROUPKEYS this queue counts its groups: declare group_ctl and backlog last')
end

local GROUP_TIME_DIGITS = '%015d'  -- a start's ms in group_starts

-- The first group_starts member of `group` at or after Redis time `ms`, as a lex bound.
local function group_starts_from(group, ms)
  return '[' .. group .. '\0' .. string.format(GROUP_TIME_DIGITS, ms)
end

-- One group's state as the call found it, read once: active (counted attempts), delta (this
-- call's change), cap (0: none), paused, frees (its attempts that ended here); its rate
-- limit: rate_tasks and rate_period (nil: none), and where the call knows the window (the
-- group_starts key declared): started (its starts in the window), started_here (this
-- call's); due: when the call parked some for its rate, the time it may start again.
local function group_state(c, group)
  local e = c.groups[group]
  if e == nil then
    local f = redis.call('HMGET', c.ctl, 'a:' .. group, 'm:' .. group, 'p:' .. group, 'r:' .. group)
    local cap = tonumber(f[2])
    if cap == nil then cap = meta_value('group_max_active') or 0 end
    e = {active = math.max(tonumber(f[1]) or 0, 0), delta = 0, cap = math.max(math.floor(cap), 0),
      paused = f[3] == '1', frees = 0, group = group, started_here = 0}
    e.rate_tasks, e.rate_period = rate_limit_of(f[4] or meta_text('group_rate_limit'))  -- "0": none
    if e.rate_tasks and c.starts then
      e.started = redis.call('ZLEXCOUNT', c.starts, group_starts_from(group, now_ms() - rate_span(e.rate_period) + 1),
        '(' .. group .. '\1')
    end
    c.groups[group] = e
    c.order[#c.order + 1] = e
  end
  return e
end

-- How many more of the group's starts its rate limit allows now (a large number without one,
-- or where the call cannot see the window).
local function rate_room(e)
  if not e.started then return 2147483647 end
  return math.max(e.rate_tasks - e.started - e.started_here, 0)
end

-- How many more of the group's attempts may start now (0 while paused; a large number without a cap).
local function group_room(e)
  if e.paused then return 0 end
  local room = rate_room(e)
  if e.cap == 0 then return room end
  return math.min(math.max(e.cap - e.active - e.delta, 0), room)
end

-- The Redis time the group's window allows a start again, after `extra` more starts now:
-- when the start that would then be the `rate_tasks`-th newest leaves it.
local function rate_due(c, e, extra)
  local span = rate_span(e.rate_period)
  local nth = e.started + e.started_here + extra - e.rate_tasks  -- 0-based, oldest first
  if nth < 0 then return now_ms() end
  if nth >= e.started then return now_ms() + span end  -- one of this call's: it starts now
  local oldest = redis.call('ZRANGE', c.starts, group_starts_from(e.group, now_ms() - span + 1), '(' .. e.group .. '\1',
    'BYLEX', 'LIMIT', int_text(nth), '1')
  return tonumber(string.sub(oldest[1], #e.group + 2, #e.group + 16)) + span
end

-- Acquire's decision for a pick of `group`: true: lease it (counted), false: park it (held by
-- its rate limit: e.due says when to hand it back).
local function may_start(c, group)
  local e = group_state(c, group)
  if group_room(e) <= 0 then
    if rate_room(e) <= 0 and not e.due then e.due = rate_due(c, e, 0) end
    return false
  end
  e.delta = e.delta + 1
  if e.started then e.started_here = e.started_here + 1 end
  return true
end

-- The attempt under `token` of the task under `key` (`extra`: its extra field as read;
-- `group`: its group when read already) ended: its group's slot frees, when acquire counted
-- it (a token after the one counting started from).
local function slot_freed(key, extra, token, group)
  local c = call.caps
  if c == nil then return end
  local seq = tonumber(string.match(token or '', ':(%d+)$'))
  if not seq or seq <= c.from then return end
  if group == nil then
    if lists_extra(extra, '[g]') == false then return end
    group = redis.call('HGET', key, 'group')
  end
  if not group or group == '' then return end
  local e = group_state(c, group)
  e.delta = e.delta - 1
  e.frees = e.frees + 1
end

-- The backlog member of a task of `group` parked with waiting score `score`.
local function parked_member(group, score, id)
  return group .. '\0' .. string.format('%016d', score + 2251799813685248) .. id
end

-- Park a picked task of `group` whose waiting score is `score` (acquire: its removal from
-- waiting is the caller's write).
local function park(c, id, key, group, score)
  write('ZADD', c.backlog, '0', parked_member(group, score, id))
  write('HSET', key, 'parked', int_text(score))
  group_left(group)
end

-- Hand back up to `n` (at most 1,000) of the group's first parked tasks to waiting, at their
-- old scores: how many, and the backlog member of the last. A second call for a group in the
-- same call (acquire: a group due, then its attempts' ends) goes on after the first's.
local function hand_back(c, group, n)
  if n <= 0 then return 0, nil end
  local before = c.handed_of[group] or 0
  local members = redis.call('ZRANGE', c.backlog, '[' .. group .. '\0', '(' .. group .. '\1', 'BYLEX', 'LIMIT',
    int_text(before), int_text(math.min(n, 1000)))
  c.handed_of[group] = before + #members
  local skip = #group + 1
  for _, member in ipairs(members) do
    local score = tonumber(string.sub(member, skip + 1, skip + 16)) - 2251799813685248
    local id = string.sub(member, skip + 17)
    write('ZREM', c.backlog, member)
    write('ZADD', K_WAITING, int_text(score), id)
    group_returned(group, score)
    c.handed[#c.handed + 1] = id
    c.scores[#c.scores + 1] = score
  end
  return #members, members[#members]
end

-- The starts of the group after `group` in group_starts (in lex order, else the first group)
-- that its window no longer counts (all of them when it has no limit now) go: a call that
-- logs starts sweeps one neighbour, so the starts of groups that stopped starting go too
-- (a swept group leaves the log, and the next call's neighbour is the one after it).
local function sweep_neighbour(c, group)
  local next_member = redis.call('ZRANGE', c.starts, '(' .. group .. '\1', '+', 'BYLEX', 'LIMIT', '0', '1')[1] or
    redis.call('ZRANGE', c.starts, '-', '+', 'BYLEX', 'LIMIT', '0', '1')[1]
  if not next_member then return end
  local name = string.sub(next_member, 1, string.find(next_member, '\0', 1, true) - 1)
  if name == group then return end
  local e = group_state(c, name)
  local kept_from = e.rate_tasks and now_ms() - rate_span(e.rate_period) + 1 or now_ms() + 1
  write('ZREMRANGEBYLEX', c.starts, '[' .. name .. '\0', '(' .. string.sub(group_starts_from(name, kept_from), 2))
end

-- The call's counts written, and for each attempt that ended here one of its group's parked
-- tasks handed back while the group has room (16 of a group without a cap): tasks handed
-- back are not counted until leased, so more would overshoot. A cap raised is
-- configure_group's to let go. commit_writes calls this first: its reads come before every write.
local function caps_flush()
  local c = call.caps
  for _, e in ipairs(c.order) do
    if e.started_here > 0 then
      sweep_neighbour(c, e.group)
      break
    end
  end
  for _, e in ipairs(c.order) do
    if e.frees > 0 and not (e.rate_tasks and not e.started and e.cap == 0) then
      hand_back(c, e.group, math.min(group_room(e), e.cap == 0 and 16 or e.frees))
    end
    if e.due then write('ZADD', c.due, int_text(e.due), e.group) end
    if e.started_here > 0 then  -- its starts logged by the caller (acquire); the old ones go
      write('ZREMRANGEBYLEX', c.starts, '[' .. e.group .. '\0',
        '(' .. string.sub(group_starts_from(e.group, now_ms() - rate_span(e.rate_period) + 1), 2))
      local span = rate_span(e.rate_period)
      if span > (c.starts_ttl or 0) then
        c.starts_ttl = math.max(span, redis.call('PTTL', c.starts))
        write('PEXPIRE', c.starts, int_text(c.starts_ttl))
      end
    end
    if e.delta ~= 0 then
      local active = math.max(e.active + e.delta, 0)
      if active == 0 then
        write('HDEL', c.ctl, 'a:' .. e.group)
      else
        write('HSET', c.ctl, 'a:' .. e.group, int_text(active))
      end
    end
  end
  if #c.handed > 0 then wake_groups(c.handed, c.scores) end
  call.caps = nil
end

-- This call's group bookkeeping (call.caps) when the queue counts its groups' attempts,
-- else nil. `keys`: declared_last's of the script's last keys (group_ctl, backlog among them).
local function use_caps(keys)
  local from = caps_from()
  if from == nil then return nil end
  if call.caps == nil then
    call.caps = {ctl = keys.group_ctl, backlog = keys.backlog, starts = keys.group_starts, due = keys.group_due,
      from = from, groups = {}, order = {}, handed = {}, handed_of = {}, scores = {}, flush = caps_flush,
      freed = slot_freed}  -- (leases.lua's complete_each calls freed)
  end
  return call.caps
end
