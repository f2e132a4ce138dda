--[[ rate.lua: a queue's rate limit: at most `tasks` leases start in any window of `period` ms.

The log of starts, the queue key "starts" that acquire and stats declare last:
  starts  zset of the leases started lately: member = the lease's sequence number (its
          token's last part: unique in the queue, and never the token, a capability),
          score = Redis time of its start (ms). Trimmed to the newest `tasks` entries and
          expiring one span (rate_span) after the last start: bounded whatever the traffic.
A hold (TaskQueue.hold_starts, hold.lua) is meta held_until_ms: the Redis time before
which no lease starts, only ever extended.
]]
--- @include "call"
--- @include "keys"
--- @include "time"
--- @include "meta"

local MAX_RATE_TASKS = 100000  -- protocol.MAX_RATE_TASKS
local MAX_RATE_PERIOD_MS = 86400000  -- protocol.MAX_RATE_PERIOD
local MAX_HOLD_MS = 86400000  -- protocol.MAX_HOLD
local RATE_GUARD_MS = 20  -- protocol.RATE_GUARD

-- The span a start counts for: the period and a guard of 1 % of it, at most RATE_GUARD_MS.
-- A handler starts a few ms after its lease, by a delay that varies: without the guard, a
-- burst leased the moment the window allows it reaches the downstream service a few ms
-- inside the window of the burst before it.
local function rate_span(period)
  return period + math.min(math.floor(period / 100), RATE_GUARD_MS)
end

-- A limit in its stored form ("<tasks> <period_ms>") clamped within its bounds: tasks,
-- period_ms; nil when there is none (or it cannot be read).
local function rate_limit_of(text)
  local tasks, period = string.match(text or '', '^(%d+) (%d+)$')
  if not tasks then return nil end
  return math.min(math.max(tonumber(tasks), 1), MAX_RATE_TASKS), math.min(math.max(tonumber(period), 1),
    MAX_RATE_PERIOD_MS)
end

-- The leases started in the span that ends now, and the Redis time (ms) the next may
-- start: now while fewer than `tasks` did, else when the oldest that counts leaves it.
local function rate_window(key, tasks, period)
  local span = rate_span(period)
  local since = '(' .. int_text(now_ms() - span)
  local started = redis.call('ZCOUNT', key, since, '+inf')
  if started < tasks then return started, now_ms() end
  local oldest = redis.call('ZRANGE', key, since, '+inf', 'BYSCORE', 'LIMIT', int_text(started - tasks), '1',
    'WITHSCORES')
  return started, tonumber(oldest[2]) + span
end

-- The Redis time (ms) before which starts are held, at most MAX_HOLD_MS ahead; nil: not held.
local function held_until()
  local held = meta_value('held_until_ms')
  if held == nil or held <= now_ms() then return nil end
  return math.min(held, now_ms() + MAX_HOLD_MS)
end
