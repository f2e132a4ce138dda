--[[ lib.lua: helpers prepended to every script at load time.

Every script receives the same queue-level KEYS first (all share the queue's hash tag):
  KEYS[1]  base        "{emq:<queue>}:"  a prefix, never read or written: task hashes are
                                          base.."t:"..id, channels base.."wake" and
                                          base.."done:"..id
  KEYS[2]  waiting     zset, score = -priority * 2^40 + seq (FIFO within priority)
  KEYS[3]  delayed     zset, score = due time (ms)
  KEYS[4]  active      zset, score = lease deadline (ms)
  KEYS[5]  completed   zset, score = expiry of the record (ms, +inf = keep)
  KEYS[6]  failed      zset (dead letters), score = expiry of the record
  KEYS[7]  canceled    zset, score = expiry of the record
  KEYS[8]  dedup       zset of forgotten explicit task ids, score = end of dedup window
  KEYS[9]  meta        hash of queue-level settings (paused, max_active, ...)
  KEYS[10] events      stream of lifecycle events, trimmed approximately
  KEYS[11] seq         counter for FIFO order and lease tokens
  KEYS[12] ready_since zset of waiting ids, score = time it became ready (oldest-waiting age)
  KEYS[13] workers     hash of live worker processes: name -> "in_flight concurrency expires_ms"
  KEYS[14] settled     zset of settlements whose record is gone while a resend may still come:
                       outcome..":"..token, score = the lease deadline plus a slack
  KEYS[15] waiters     zset of task ids somebody waits on (TaskQueue.wait), score = expiry
                       of that interest; a settlement publishes base.."done:"..id only then
  KEYS[16] peeked      string "token_prefix score": the last waiting id an acquire reply
                       named, so that the next caller is named the ids after it
After them (KEYS[17...]) come the task hashes the call touches, and a script touches no
other task hash: every key is declared before the call, as Redis Cluster and proxies that
route on KEYS require. task_key(id) gives only a declared key and raises
"ERR undeclared task key" otherwise, so a script cannot break the rule unnoticed. The
caller knows the ids first: they are its arguments (offer, settle, cancel, ...), or ids an
earlier reply, a wake message or the caller's own offers named (acquire), or ids read
with plain commands (maintain); the script checks each again, by Redis time.
All times come from Redis TIME, in milliseconds.

DEFAULTS, the queue settings' values when the meta hash has none, is a table that
scripts.py writes before this file from protocol.SETTING_DEFAULTS (Python is their one
source); defaults that depend on the caller come in each script's ARGV.

Each script's header lists its arguments and reply in this form, which
tests/runtime/test_protocol.py holds against the dataclasses of protocol.py:
  KEYS: the queue keys of lib.lua, then ...     the task hashes it declares
  ARGV[n] name  notes                 one value
  ARGV[n...] name...: k values each: a, b, c
                                      records of k values from ARGV[n] to the end
  Returns: name  notes                one value
  Returns: {a, b, name...}            a table; name... stands for the values that follow
  name...: k values each: a, b, c     ... when they are records of k values
A list goes on to the next line after a trailing comma; other lines are notes.
]]
local BASE = KEYS[1]
local K_WAITING, K_DELAYED, K_ACTIVE = KEYS[2], KEYS[3], KEYS[4]
local K_COMPLETED, K_FAILED, K_CANCELED = KEYS[5], KEYS[6], KEYS[7]
local K_DEDUP, K_META, K_EVENTS, K_SEQ, K_READY_SINCE = KEYS[8], KEYS[9], KEYS[10], KEYS[11], KEYS[12]
local K_WORKERS, K_SETTLED, K_WAITERS, K_PEEKED = KEYS[13], KEYS[14], KEYS[15], KEYS[16]
local QUEUE_KEYS = 16  -- KEYS after these are task hashes
local TASK_PREFIX = BASE .. 't:'
local DECLARED = {}  -- the declared task hashes
for i = QUEUE_KEYS + 1, #KEYS do DECLARED[KEYS[i]] = true end

-- The ids of the declared task hashes, in KEYS order, each once.
local function declared_ids()
  local ids, seen = {}, {}
  for i = QUEUE_KEYS + 1, #KEYS do
    if not seen[KEYS[i]] then
      seen[KEYS[i]] = true
      ids[#ids + 1] = string.sub(KEYS[i], #TASK_PREFIX + 1)
    end
  end
  return ids
end

-- How an attempt settled (protocol.Outcome); 0 = not settled by that token (lease lost).
local OUTCOME_COMPLETED, OUTCOME_RETRY, OUTCOME_FAILED, OUTCOME_RELEASED = 1, 2, 3, 4
-- A worker resends an acknowledgement only while its lease may still be valid, so the
-- outcome of a deleted record is remembered until the lease's deadline, plus this slack.
local SETTLED_SLACK_MS = 5000
local PRIORITY_SPAN = 1099511627776 -- 2^40 sequence numbers per priority band

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The task hash of `id`, which the caller must have declared in KEYS.
local function task_key(id)
  local key = TASK_PREFIX .. id
  if not DECLARED[key] then error({err = 'ERR undeclared task key ' .. key}) end
  return key
end

local meta_cache = nil
-- Queue-level setting from the meta hash, or the caller's default.
local function meta_num(field, fallback)
  if meta_cache == nil then
    meta_cache = {}
    local flat = redis.call('HGETALL', K_META)
    for i = 1, #flat, 2 do meta_cache[flat[i]] = flat[i + 1] end
  end
  local v = meta_cache[field]
  if v ~= nil and v ~= '' then return tonumber(v) end
  return tonumber(fallback)
end

-- A per-task option stored as a number, where -1 means "use the queue's value".
local function task_option(key, field, meta_field, fallback)
  local v = tonumber(redis.call('HGET', key, field) or '-1')
  if v == nil or v < 0 then return meta_num(meta_field, fallback) end
  return v
end

local function emit(event, id, ...)
  local maxlen = meta_num('events_maxlen', DEFAULTS.events_maxlen)
  if maxlen > 0 then
    redis.call('XADD', K_EVENTS, 'MAXLEN', '~', maxlen, '*', 'event', event, 'id', id, ...)
  end
end

-- Idle workers may acquire again. `ids` (optional) names tasks now waiting: the message
-- carries the first WAKE_IDS of them (a JSON array), which a woken worker declares at
-- once instead of asking which ids are ready first.
local WAKE_IDS = 16
local function wake(ids)
  local message = '1'
  if ids and #ids > 0 then
    message = cjson.encode({unpack(ids, 1, math.min(#ids, WAKE_IDS))})
  end
  redis.call('PUBLISH', BASE .. 'wake', message)
end

-- Put a task into the waiting index (its priority band, FIFO by seq).
local function enqueue_waiting(id, key, now)
  local prio = tonumber(redis.call('HGET', key, 'priority') or '0')
  local seq = redis.call('INCR', K_SEQ)
  redis.call('ZADD', K_WAITING, (-prio) * PRIORITY_SPAN + seq, id)
  redis.call('ZADD', K_READY_SINCE, now, id)
  redis.call('HSET', key, 'state', 'waiting', 'ready_at', now)
end

local function enqueue_delayed(id, key, due)
  redis.call('ZADD', K_DELAYED, due, id)
  redis.call('HSET', key, 'state', 'delayed', 'ready_at', due)
end

-- Drop a task record; an explicit id stays reserved in the dedup index, and the last
-- settlement's outcome stays known to a resent acknowledgement for a while.
local function forget(id, key, now)
  local f = redis.call('HMGET', key, 'explicit_id', 'last_token', 'last_outcome', 'lock_until')
  if f[1] == '1' then
    local window = meta_num('dedup_window_ms', DEFAULTS.dedup_window_ms)
    redis.call('ZADD', K_DEDUP, now + window, id)
  end
  local resend_until = (tonumber(f[4]) or 0) + SETTLED_SLACK_MS
  if f[2] and f[2] ~= '' and f[3] and resend_until > now then  -- a resend may still come
    redis.call('ZADD', K_SETTLED, resend_until, f[3] .. ':' .. f[2])
  end
  redis.call('DEL', key)
end

-- Remember that `token` settled this task with `outcome`.
local function record_outcome(key, token, outcome)
  redis.call('HSET', key, 'token', '', 'last_token', token, 'last_outcome', outcome)
end

-- How `token` settled this task (0 = it did not, or it is no longer known).
local function outcome_of(id, token)
  if token == '' then return 0 end
  local f = redis.call('HMGET', task_key(id), 'last_token', 'last_outcome')
  if f[1] == token then return tonumber(f[2]) or 0 end
  for outcome = OUTCOME_COMPLETED, OUTCOME_RELEASED do
    if redis.call('ZSCORE', K_SETTLED, outcome .. ':' .. token) then return outcome end
  end
  return 0
end

-- A slot under max_active was freed: waiting workers may acquire again.
local function freed_slot()
  if meta_num('max_active', DEFAULTS.max_active) > 0 then wake() end
end

-- ZREM many members without overflowing Lua's stack with unpack().
local function zrem_all(index, members)
  for i = 1, #members, 1000 do
    redis.call('ZREM', index, unpack(members, i, math.min(i + 999, #members)))
  end
end

-- Does anybody wait on some task? (Read once per call: nothing else adds waiters meanwhile.)
local anybody_waits = nil

-- Move a task into a terminal state and its retention index; wake its waiters, if any
-- (a PUBLISH reaches every node of a cluster: none is sent when nobody waits).
local function settle(id, key, state, index_key, retention_ms, now)
  redis.call('HSET', key, 'state', state, 'finished_at', now, 'token', '')
  if anybody_waits == nil then anybody_waits = redis.call('EXISTS', K_WAITERS) == 1 end
  if anybody_waits and redis.call('ZREM', K_WAITERS, id) == 1 then
    redis.call('PUBLISH', BASE .. 'done:' .. id, state)
  end
  if retention_ms == 0 then
    forget(id, key, now)
  elseif retention_ms < 0 then
    redis.call('ZADD', index_key, '+inf', id)
  else
    redis.call('ZADD', index_key, now + retention_ms, id)
  end
end

-- Is the caller the current owner, with a lease that has not run out by Redis time?
-- Returns the task key when it is.
local function owned(id, token, now)
  local key = task_key(id)
  local st = redis.call('HMGET', key, 'state', 'token', 'lock_until')
  if st[1] == 'active' and st[2] == token and token ~= '' and tonumber(st[3]) >= now then
    return key
  end
  return nil
end

local function drop_from_indexes(id, state)
  if state == 'waiting' then
    redis.call('ZREM', K_WAITING, id)
    redis.call('ZREM', K_READY_SINCE, id)
  elseif state == 'delayed' then
    redis.call('ZREM', K_DELAYED, id)
  elseif state == 'active' then
    redis.call('ZREM', K_ACTIVE, id)
  elseif state == 'completed' then
    redis.call('ZREM', K_COMPLETED, id)
  elseif state == 'failed' then
    redis.call('ZREM', K_FAILED, id)
  elseif state == 'canceled' then
    redis.call('ZREM', K_CANCELED, id)
  end
end

-- Move a declared delayed task into waiting if it is due; true when it was.
local function promote_if_due(id, now)
  local due = redis.call('ZSCORE', K_DELAYED, id)
  if not due or tonumber(due) > now then return false end
  redis.call('ZREM', K_DELAYED, id)
  local key = task_key(id)
  if redis.call('EXISTS', key) == 1 then
    enqueue_waiting(id, key, now)
  end
  return true
end

local function next_due()
  local first = redis.call('ZRANGE', K_DELAYED, 0, 0, 'WITHSCORES')
  if first[2] then return tonumber(first[2]) end
  return -1
end
