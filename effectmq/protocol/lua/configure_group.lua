--[[ configure_group: a group's own cap on attempts running at once, its rate limit and its
pause, then the parked tasks these let go back to waiting; or, for no group, the parked tasks of every group
that the caps and rate limits in force let go now (after the queue's group_max_active or
group_rate_limit changed). See group_caps.lua. The first cap, rate limit or pause of a queue
starts the counting (meta group_caps).
KEYS: the queue keys of keys.lua.
Last KEYS: group_starts, group_due, group_ctl, backlog
ARGV[1] group       '' = every group, from `after` on
ARGV[2] max_active  '' = unchanged; -1 = the queue's group_max_active; 0 = no cap; N > 0 = its cap
ARGV[3] paused      '' = unchanged; 1 = pause; 0 = resume
ARGV[4] batch       at most this many parked tasks go back (1 to 1,000): call again while `more`
ARGV[5] after       the `more` of the call before ('' = the first call): the tasks it handed
  back (a group's: they count against its room until leased), or where it stopped (no group)
ARGV[6] rate_limit  '' = unchanged; -1 = the queue's group_rate_limit; 0 = none;
  "<tasks> <period_ms>" its own (clamped as rate.lua clamps)
Returns: {waiting, active, parked, max_active, paused, more, rate_tasks, rate_period_ms}
  the group's after the call (no group: parked is the queue's, the others 0): waiting
  tasks, counted attempts running, parked tasks, its cap in force (0 = none), paused 0 | 1;
  more: '' = done, else call again with `after` = more (and the group, no change); its
  rate limit in force (0 0 = none)
With no group, each group with parked tasks gets one look: it hands back what its room
allows, at most what is left of the batch (a group whose room was larger hands back the
rest as its attempts end: group_caps.lua).
A bad argument is an error reply that names it; nothing is written then.
]]
--- @include "keys"
--- @include "time"
--- @include "writes"
--- @include "meta"
--- @include "wake"
--- @include "group_caps"
local group, max_active, paused, after, rate = ARGV[1], ARGV[2], ARGV[3], ARGV[5], ARGV[6] or ''
local keys = declared_last({'group_starts', 'group_due', 'group_ctl', 'backlog'})
local cap = tonumber(max_active)
if max_active ~= '' and (cap == nil or cap ~= math.floor(cap) or cap < -1 or cap > 2147483647) then
  return redis.error_reply('ERR invalid group setting: max_active must be -1 or an integer from 0 to 2147483647')
end
if paused ~= '' and paused ~= '1' and paused ~= '0' then
  return redis.error_reply('ERR invalid group setting: paused must be 1 or 0')
end
if rate ~= '' and rate ~= '-1' and rate ~= '0' and not rate_limit_of(rate) then
  return redis.error_reply('ERR invalid group setting: rate_limit must be -1, 0 or "<tasks> <period_ms>"')
end
if group == '' and rate ~= '' then
  return redis.error_reply('ERR invalid group setting: rate_limit needs a group')
end
local batch = math.max(1, math.min(math.floor(tonumber(ARGV[4]) or 1), 1000))
if group ~= '' and after ~= '' and not string.find(after, '^%d+$') then
  return redis.error_reply('ERR invalid group setting: after must be empty or the more of a call')
end
if group == '' then
  if after ~= '' and not string.find(after, '^%[') then
    return redis.error_reply('ERR invalid group setting: after must be empty or the more of a call')
  end
  local caps = use_caps(keys)
  if caps == nil then return {0, 0, 0, 0, 0, '', 0, 0} end  -- nothing was ever parked
  local from, budget, handed = after ~= '' and after or '-', batch, 0
  for _ = 1, batch do  -- a group a step: bounded
    local first = redis.call('ZRANGE', keys.backlog, from, '+', 'BYLEX', 'LIMIT', '0', '1')
    if not first[1] then
      from = ''
      break
    end
    local name = string.sub(first[1], 1, string.find(first[1], '\0', 1, true) - 1)
    local n = hand_back(caps, name, math.min(group_room(group_state(caps, name)), budget))
    handed, budget = handed + n, budget - n
    from = '[' .. name .. '\1'  -- past this group
    if budget == 0 then break end
  end
  local parked = redis.call('ZCARD', keys.backlog) - handed
  commit()
  return {0, 0, parked, 0, 0, from, 0, 0}
end
local starts = caps_from() == nil and ((cap or 0) > 0 or paused == '1' or rate_limit_of(rate) ~= nil)
if starts then
  local seq = redis.call('GET', K_SEQ) or '0'
  write('HSET', K_META, 'group_caps', seq)
  call.meta.group_caps = seq
end
local caps = use_caps(keys)
local e = caps and group_state(caps, group) or {active = 0, delta = 0, paused = false}
if max_active == '-1' then
  write('HDEL', keys.group_ctl, 'm:' .. group)
  e.cap = math.max(math.floor(meta_value('group_max_active') or 0), 0)
elseif max_active ~= '' then
  write('HSET', keys.group_ctl, 'm:' .. group, int_text(cap))
  e.cap = cap
elseif not caps then
  e.cap = math.max(math.floor(tonumber(redis.call('HGET', keys.group_ctl, 'm:' .. group)) or
    meta_value('group_max_active') or 0), 0)
end
if rate == '-1' then
  write('HDEL', keys.group_ctl, 'r:' .. group)
elseif rate ~= '' then
  write('HSET', keys.group_ctl, 'r:' .. group, rate)
end
if rate ~= '' and caps then  -- the limit in force now, and its window
  e.rate_tasks, e.rate_period = rate_limit_of(rate == '-1' and meta_text('group_rate_limit') or rate)
  e.started = nil
  if e.rate_tasks then
    e.started = redis.call('ZLEXCOUNT', keys.group_starts,
      group_starts_from(group, now_ms() - rate_span(e.rate_period) + 1), '(' .. group .. '\1')
  end
end
if paused == '1' then
  write('HSET', keys.group_ctl, 'p:' .. group, '1')
  e.paused = true
elseif paused == '0' then
  write('HDEL', keys.group_ctl, 'p:' .. group)
  e.paused = false
elseif not caps then
  e.paused = redis.call('HGET', keys.group_ctl, 'p:' .. group) == '1'
end
local parked = redis.call('ZLEXCOUNT', keys.backlog, '[' .. group .. '\0', '(' .. group .. '\1')
local before = tonumber(after) or 0  -- handed back by the calls before, not leased yet
local room = math.max(group_room(e) - before, 0)
local handed = caps and hand_back(caps, group, math.min(room, batch)) or 0
local waiting = (tonumber(redis.call('ZSCORE', K_GROUPS, group)) or 0) + handed
local more = (handed == batch and parked > handed and room > handed) and int_text(before + handed) or ''
local rate_tasks, rate_period = e.rate_tasks, e.rate_period
if not caps then  -- no limit either (a limit starts the counting), unless set by an older version
  rate_tasks, rate_period = rate_limit_of(redis.call('HGET', keys.group_ctl, 'r:' .. group) or
    meta_text('group_rate_limit'))
end
commit()
return {waiting, e.active, parked - handed, e.cap, e.paused and 1 or 0, more, rate_tasks or 0, rate_period or 0}
