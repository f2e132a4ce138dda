--[[ stats: counts per state, and the ids whose age is the oldest waiting age.
KEYS: the queue keys of keys.lua.
Last KEYS: starts, group_ctl, backlog
  (group_ctl and backlog only once the caller knows the queue counts its groups: group_caps.lua)
Returns: {now, waiting, delayed, active, completed, failed, canceled, paused, max_active,
  rate_tasks, rate_period_ms, rate_started, held_until, parked, counting, heads...}
  paused: 0 | 1
  parked: waiting tasks held back by their group's cap or pause (group_caps.lua)
  counting: 1 once a group cap or pause was set (attempts count against their groups), else 0
  rate_tasks, rate_period_ms: the queue's rate limit (0 0: none; rate.lua); rate_started:
  the leases started in the window that ends now; held_until: the Redis time (ms) a hold of
  starts ends, -1 when none
  heads...: the first waiting id of each priority band (at most STATS_BANDS bands, from the
  highest priority): tasks join a band in the order they became ready, so its first one
  waited longest. The caller reads their ready_at, or created_at when there is none (a
  script reads only declared hashes).
]]
--- @include "keys"
--- @include "time"
--- @include "meta"
--- @include "indexes"
--- @include "rate"
--- @include "group_caps"
local STATS_BANDS = 16
local group_keys = group_key_count()
if not group_keys then return group_keys_refused() end
local now = now_ms()
local last = group_keys > 0 and declared_last({'starts', 'group_ctl', 'backlog'}) or declared_last({'starts'})
local out = {now, redis.call('ZCARD', K_WAITING), redis.call('ZCARD', K_DELAYED),
  redis.call('ZCARD', K_ACTIVE), redis.call('ZCARD', K_COMPLETED), redis.call('ZCARD', K_FAILED),
  redis.call('ZCARD', K_CANCELED), meta_num('paused', DEFAULTS.paused),
  meta_num('max_active', DEFAULTS.max_active)}
local rate_tasks, rate_period = rate_limit_of(meta_text('rate_limit'))
local started = 0
if rate_tasks then started = rate_window(last.starts, rate_tasks, rate_period) end
out[10], out[11], out[12], out[13] = rate_tasks or 0, rate_period or 0, started, held_until() or -1
out[14], out[15] = group_keys > 0 and redis.call('ZCARD', last.backlog) or 0, caps_from() and 1 or 0
local from = '-inf'
for _ = 1, STATS_BANDS do
  local head = redis.call('ZRANGE', K_WAITING, from, '+inf', 'BYSCORE', 'LIMIT', 0, 1, 'WITHSCORES')
  if not head[1] then break end
  out[#out + 1] = head[1]
  -- The next band starts at the next multiple of PRIORITY_SPAN (sequence numbers start at 1).
  from = string.format('%.0f', (math.floor(tonumber(head[2]) / PRIORITY_SPAN) + 1) * PRIORITY_SPAN)
end
return out
