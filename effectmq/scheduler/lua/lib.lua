--[[ lib.lua: helpers prepended to every scheduler script at load time.

Every script receives the same KEYS (all share the hash tag {<prefix>-sched:<namespace>}):
  KEYS[1]  base   "{emq-sched:<ns>}:"  schedule hashes are base.."s:"..id
  KEYS[2]  due    zset id -> next fire time (ms); 0 = look at it now; absent = suspended
  KEYS[3]  index  zset of every schedule id, score 0 (lexicographic listing)
A schedule hash holds: spec (JSON), version, timing (cron|zone), cursor (ms: ticks at
or before it are settled), suspended, next_tick, last_tick, last_task_id, counters
materialized/skipped/coalesced/backfilled, last_error, last_error_at, created_at,
updated_at. All times come from Redis TIME, in milliseconds.
]]
local BASE, K_DUE, K_INDEX = KEYS[1], KEYS[2], KEYS[3]

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function schedule_key(id)
  return BASE .. 's:' .. id
end
