--[[ lib.lua: helpers prepended to every scheduler script at load time.

Every script receives these KEYS (all share the hash tag {<prefix>-sched:<namespace>}):
  KEYS[1]   due      zset id -> next fire time (ms); 0 = look at it now; absent = suspended
  KEYS[2]   index    zset of every schedule id, score 0 (lexicographic listing)
  KEYS[3]   changes  zset id -> change number of the schedule's latest state change (numbers
                     grow by one per change); the operator's status mirror reads what changed
                     after its cursor. One entry per schedule at most: bounded like the index.
  (and "{<prefix>-sched:<ns>}:id", no script's: the store's identity, written once by the
  operator so that every URL of one Redis finds its schedules: connections.STORE_ID)
  KEYS[4..] the schedule hashes the call touches, "{<prefix>-sched:<ns>}:s:<id>". A script
            touches no key it was not given (Redis Cluster proxies route on KEYS).
A schedule hash holds: spec (JSON), version, timing (cron|zone), cursor (ms: ticks at
or before it are settled), suspended, next_tick, last_tick, last_task_id, counters
materialized/skipped/coalesced/backfilled, last_error, last_error_at, created_at,
updated_at, decided_at (see decided_at below), suspended_at and resumed_at (the last
suspension: the ticks between them are missed whatever their age). All times come
from Redis TIME, in milliseconds.
]]
local K_DUE, K_INDEX, K_CHANGES = KEYS[1], KEYS[2], KEYS[3]
local BASE = string.sub(K_DUE, 1, -4) -- the due key less "due": "{<prefix>-sched:<ns>}:"
local DECLARED = {}
for i = 4, #KEYS do DECLARED[KEYS[i]] = true end

-- Validate before the first write (runtime rule 7, as the queue's lib.lua): writes are
-- queued with write() and sent by commit() at the end of a script, after every read and
-- check, so a script that fails has written nothing.
local queued_writes = {}
local function write(...)
  queued_writes[#queued_writes + 1] = {...}
end
local function commit()
  for i = 1, #queued_writes do redis.call(unpack(queued_writes[i])) end
  queued_writes = {}
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function schedule_key(id)
  local key = BASE .. 's:' .. id
  if not DECLARED[key] then
    error('schedule hash ' .. key .. ' is not declared in KEYS')
  end
  return key
end

local last_change = nil
local function changed(id)
  if not last_change then
    local top = redis.call('ZRANGE', K_CHANGES, -1, -1, 'WITHSCORES')
    last_change = tonumber(top[2]) or 0
  end
  last_change = last_change + 1
  write('ZADD', K_CHANGES, last_change, id)
end

local function forget(id)
  write('ZREM', K_DUE, id)
  write('ZREM', K_CHANGES, id)
end

-- The Redis time every decision from a schedule's version and cursor is made with: the
-- first read of them fixes it (field decided_at = "<ms>:<version>:<cursor>"), so every
-- pass deciding from that cursor decides the same ticks, spans and counts, and a pass
-- that stopped after its offers and before its cursor update is redone exactly, by
-- whichever scheduler comes next. advance clears it when it commits a cursor.
local function decided_at(key, version, cursor, stamp, now)
  local suffix = ':' .. version .. ':' .. cursor
  if stamp and #stamp > #suffix and string.sub(stamp, -#suffix) == suffix then
    return string.sub(stamp, 1, #stamp - #suffix)
  end
  local ms = string.format('%d', now)
  write('HSET', key, 'decided_at', ms .. suffix)
  return ms
end

-- The last suspension as "<suspended_at>:<resumed_at>", '' if none ended yet.
local function suspension(since, ended)
  if since and ended and tonumber(since) and tonumber(ended) then
    return since .. ':' .. ended
  end
  return ''
end
