--[[ lib.lua: helpers of every script (each EVAL script carries those it uses; the function
library defines them once, see scripts.py).

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
  KEYS[10] events      stream of lifecycle events, trimmed approximately; written only
                       while somebody asked for events lately (meta events_until, set by
                       TaskQueue.want_events) or always (meta events_always = 1)
  KEYS[11] seq         counter for FIFO order and lease tokens
  KEYS[12] minutes     hash of tasks settled per minute, in MINUTE_SLOTS ring slots:
                       "m:<slot>" = the minute (ms / 60000) the slot counts, "c:<slot>" =
                       completed, "f:<slot>" = failed for good in that minute
  KEYS[13] workers     hash of live worker processes: name -> "in_flight concurrency expires_ms"
  KEYS[14] settled     zset of settlements whose record is gone while a resend may still come:
                       outcome..":"..token, score = the lease deadline plus a slack (a
                       completion that deletes its record is kept in its call's receipt)
  KEYS[15] waiters     zset of task ids somebody waits on (TaskQueue.wait), score = expiry
                       of that interest; a settlement publishes base.."done:"..id only then
  KEYS[16] peeked      string "token_prefix score": the last waiting id an acquire reply
                       named, so that the next caller is named the ids after it
After them (KEYS[17...]) come the task hashes the call touches, then the receipts it
writes or reads (base.."r:"..receipt, see use_receipts), and a script touches no other
task hash: every key is declared before the call, as Redis Cluster and proxies that
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
local K_DEDUP, K_META, K_EVENTS, K_SEQ, K_MINUTES = KEYS[8], KEYS[9], KEYS[10], KEYS[11], KEYS[12]
local K_WORKERS, K_SETTLED, K_WAITERS, K_PEEKED = KEYS[13], KEYS[14], KEYS[15], KEYS[16]
local QUEUE_KEYS = 16  -- KEYS after these are task hashes
local TASK_PREFIX = BASE .. 't:'
local DECLARED = nil  -- the declared task hashes, a set built on the first lookup

-- VALIDATE BEFORE THE FIRST WRITE (runtime rule 7). Redis keeps what a script wrote before
-- it failed, so no script calls a write command itself: it queues it with write(), and
-- commit(), at its end (finish), sends the queued writes in order. Every read, decode,
-- encode and check of a call thus comes before its first write, and after that only
-- writes whose arguments are already computed run: nothing that can fail. Reads see the
-- state before the call; what the call itself changed it keeps in its own tables (seq_used,
-- settled_here, created_here). Notifications are hints (hint()): sent after the writes,
-- through pcall, so a channel an ACL denies never fails a call.
-- tests/runtime/test_write_rule.py injects an error at every step of every script.
local queued_writes = {}  -- this call's writes, in order, each a command table
local queued_hints = {}  -- this call's PUBLISHes, sent after its writes
local function write(...)
  queued_writes[#queued_writes + 1] = {...}
end
local function hint(...)
  queued_hints[#queued_hints + 1] = {...}
end

-- The ids of the declared task hashes, in KEYS order, each once (after the first `skip`,
-- before the last `tail`: receipts), and their keys by id.
local function declared_ids(skip, tail)
  local ids, key_of = {}, {}
  for i = QUEUE_KEYS + 1 + (skip or 0), #KEYS - (tail or 0) do
    local id = string.sub(KEYS[i], #TASK_PREFIX + 1)
    if not key_of[id] then
      key_of[id] = KEYS[i]
      ids[#ids + 1] = id
    end
  end
  return ids, key_of
end

-- The optional fields of a task hash, left out at their defaults, and their letters in
-- its `extra` field, which lists those it has ('' = none): readers look only for those.
local EXTRA_LETTER = {explicit_id = 'e', priority = 'p', max_retries = 'r', max_stalled_count = 's', options = 'o'}
local LEASE_EXTRAS = '[rop]'  -- a pattern of the letters of those a lease carries: max_retries, options, priority

-- Does a record's extra field, as read, list a letter of `letters` (a pattern)? nil when
-- it has none: a record written before there was one, which only its fields can tell.
local function lists_extra(extra, letters)
  if extra == '' then return false end
  if extra then return string.find(extra, letters) ~= nil end
  return nil
end

-- Does the record under `key` have optional field `field`? `extra`: its extra field as read.
local function has_extra(key, extra, field)
  local listed = lists_extra(extra, EXTRA_LETTER[field])
  if listed == nil then return redis.call('HEXISTS', key, field) == 1 end
  return listed
end

-- How an attempt settled (protocol.Outcome); 0 = not settled by that token (lease lost).
local OUTCOME_COMPLETED, OUTCOME_RETRY, OUTCOME_FAILED, OUTCOME_RELEASED = 1, 2, 3, 4
-- A worker resends an acknowledgement only while its lease may still be valid, so the
-- outcome of a deleted record is remembered until the lease's deadline, plus this slack.
local SETTLED_SLACK_MS = 5000
local PRIORITY_SPAN = 1099511627776 -- 2^40 sequence numbers per priority band

local now_cache = nil
-- Redis time in ms, read once per call (a script runs atomically: time stands still).
local function now_ms()
  if now_cache == nil then
    local t = redis.call('TIME')
    now_cache = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return now_cache
end

-- An integer as text. Redis turns a Lua number argument into text with printf's %.17g
-- (and Lua's `..` with %.14g): floating-point formatting, several times the cost of %d.
-- Clamped to +-2^53 (285,000 years of ms): '%d' of 2^63 or more prints a negative number,
-- and a huge retention or dedup window must mean 'for ever', never 'already over'.
local MAX_INT = 9007199254740992
local function int_text(n)
  if n > MAX_INT then n = MAX_INT elseif n < -MAX_INT then n = -MAX_INT end
  return string.format('%d', n)
end

-- Sequence numbers (FIFO order within a priority band, lease tokens): the counter is read
-- once, numbers are handed out here, and commit() adds how many were taken.
local seq_base, seq_used = nil, 0
local function take_seq(n)
  if seq_base == nil then
    seq_base = tonumber(redis.call('GET', K_SEQ) or '0')
    if seq_base == nil or seq_base ~= math.floor(seq_base) then error('corrupt sequence counter ' .. K_SEQ) end
  end
  seq_used = seq_used + n
  return seq_base + seq_used - n + 1
end

-- Send the queued writes in order, then the hints (whose failure changes nothing).
local function commit()
  for i = 1, #queued_writes do redis.call(unpack(queued_writes[i])) end
  if seq_used > 0 then
    redis.call('INCRBY', K_SEQ, int_text(seq_used))
    seq_base, seq_used = seq_base + seq_used, 0
  end
  for i = 1, #queued_hints do redis.pcall(unpack(queued_hints[i])) end
  queued_writes, queued_hints = {}, {}
end

-- What this call changed that its later reads of Redis would not show yet.
local settled_here = {}  -- lease token -> the outcome it settled with in this call
local touched = {}  -- ids this call settled: no token owns them any more
local promoted_here = 0  -- delayed tasks this call moved to waiting

local now_string = nil
-- now_ms() as text, formatted once.
local function now_text()
  if now_string == nil then now_string = int_text(now_ms()) end
  return now_string
end

-- The task hash of `id`, which the caller must have declared in KEYS.
local function task_key(id)
  local key = TASK_PREFIX .. id
  if DECLARED == nil then
    DECLARED = {}
    for i = QUEUE_KEYS + 1, #KEYS do DECLARED[KEYS[i]] = true end
  end
  if not DECLARED[key] then error('undeclared task key ' .. key) end  -- a string: 6.2 cannot raise a table
  return key
end

local meta_cache = nil
-- A number from the meta hash, or nil.
local function meta_value(field)
  if meta_cache == nil then
    meta_cache = {}
    local flat = redis.call('HGETALL', K_META)
    for i = 1, #flat, 2 do meta_cache[flat[i]] = flat[i + 1] end
  end
  local v = meta_cache[field]
  if v ~= nil and v ~= '' then return tonumber(v) end
  return nil
end

-- Queue-level setting from the meta hash, or the caller's default.
local function meta_num(field, fallback)
  return meta_value(field) or tonumber(fallback)
end

-- A per-task option stored as a number, where -1 means "use the queue's value".
local function task_option(key, field, meta_field, fallback)
  local v = tonumber(redis.call('HGET', key, field) or '-1')
  if v == nil or v < 0 then return meta_num(meta_field, fallback) end
  return v
end

-- Events are written while a reader asked for them in the last minute (or always, when
-- configured so): most queues have no reader, and a stream write per transition was the
-- largest part of Redis's work per task.
local events_on = nil
local function emit(event, id, ...)
  if events_on == nil then
    events_on = meta_num('events_maxlen', DEFAULTS.events_maxlen) > 0 and
      (meta_num('events_always', DEFAULTS.events_always) == 1 or (meta_value('events_until') or 0) > now_ms())
  end
  if events_on then
    write('XADD', K_EVENTS, 'MAXLEN', '~', meta_num('events_maxlen', DEFAULTS.events_maxlen),
      '*', 'event', event, 'id', id, 'at', now_ms(), ...)
  end
end

-- Tasks settled per minute (completed and failed for good), for throughput charts:
-- counted in the call and written once at its end (count_settled, then flush_counts).
local MINUTE_SLOTS = 180  -- three hours of minutes; a slot is reused when its minute comes again
local settled_counts = {}
local function count_settled(state)
  if state == 'completed' or state == 'failed' then
    settled_counts[state] = (settled_counts[state] or 0) + 1
  end
end
local function flush_counts()
  local c, f = settled_counts['completed'] or 0, settled_counts['failed'] or 0
  if c == 0 and f == 0 then return end
  local minute = math.floor(now_ms() / 60000)
  local slot, minute_text = int_text(minute % MINUTE_SLOTS), int_text(minute)
  if redis.call('HGET', K_MINUTES, 'm:' .. slot) == minute_text then
    if c > 0 then write('HINCRBY', K_MINUTES, 'c:' .. slot, int_text(c)) end
    if f > 0 then write('HINCRBY', K_MINUTES, 'f:' .. slot, int_text(f)) end
  else
    write('HSET', K_MINUTES, 'm:' .. slot, minute_text, 'c:' .. slot, int_text(c), 'f:' .. slot, int_text(f))
  end
  settled_counts = {}
end

-- An error as stored: the caller's JSON when it is an object Lua can read and at most
-- MAX_ERROR_BYTES long, else a placeholder that says why. Checked before any write, so
-- no error value, however odd, can stop a settlement half done.
local MAX_ERROR_BYTES = 1048576
local function stored_error(error_json, kind)
  local why
  if #error_json > MAX_ERROR_BYTES then
    why = 'larger than ' .. MAX_ERROR_BYTES .. ' bytes (' .. #error_json .. ')'
  else
    local ok, value = pcall(cjson.decode, error_json)
    if not ok then
      why = 'not readable JSON (' .. string.sub(tostring(value), 1, 200) .. ')'
    elseif type(value) ~= 'table' or type(value.tag) ~= 'string' then
      why = 'not a JSON object with a tag'
    else
      return error_json
    end
  end
  return cjson.encode({tag = '~effectmq/Error/Defect', kind = kind,
    message = 'the error could not be stored: ' .. why})
end

-- Attempts that ended without success, kept on the task (newest last, at most
-- ATTEMPTS_KEPT) for its history: {attempt, outcome, at[, error]}.
local ATTEMPTS_KEPT = 20
local function record_attempt(key, outcome, error_json, now)
  local f = redis.call('HMGET', key, 'attempt', 'attempts', 'attempt_sizes')
  local entry = '{"attempt":' .. int_text(tonumber(f[1]) or 0) .. ',"outcome":"' .. outcome .. '","at":' .. int_text(now)
  if error_json then entry = entry .. ',"error":' .. error_json end
  entry = entry .. '}'
  local body, sizes = '', {}
  local text = f[2] or '[]'
  if text ~= '[]' and text ~= '' then
    local total = 1  -- the brackets, less the comma the first entry has none of
    for size in string.gmatch(f[3] or '', '%d+') do
      sizes[#sizes + 1] = tonumber(size)
      total = total + sizes[#sizes] + 1
    end
    if #sizes > 0 and total == #text then
      body = string.sub(text, 2, -2)
    else  -- a history written before attempt_sizes (or by an older version since): read it once
      sizes = {}
      local ok, list = pcall(cjson.decode, text)
      local parts = {}
      if ok and type(list) == 'table' then
        for _, item in ipairs(list) do
          local encoded, part = pcall(cjson.encode, item)
          if encoded then
            parts[#parts + 1] = part
            sizes[#sizes + 1] = #part
          end
        end
      end
      body = table.concat(parts, ',')
    end
  end
  local drop = 0  -- bytes of the oldest entries that go
  while #sizes >= ATTEMPTS_KEPT do
    drop = drop + table.remove(sizes, 1) + 1
  end
  if drop > 0 then body = string.sub(body, drop + 1) end
  if body == '' then body = entry else body = body .. ',' .. entry end
  sizes[#sizes + 1] = #entry
  write('HSET', key, 'attempts', '[' .. body .. ']', 'attempt_sizes', table.concat(sizes, ' '))
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
  hint('PUBLISH', BASE .. 'wake', message)
end

-- Put a task into the waiting index (its priority band, FIFO by seq).
local function enqueue_waiting(id, key, now, prio)
  if prio == nil then prio = tonumber(redis.call('HGET', key, 'priority') or '0') or 0 end
  local score = (-prio) * PRIORITY_SPAN + take_seq(1)
  write('ZADD', K_WAITING, int_text(score), id)
  write('HSET', key, 'state', 'waiting', 'ready_at', int_text(now))
  return score
end

local function enqueue_delayed(id, key, due)
  write('ZADD', K_DELAYED, int_text(due), id)
  write('HSET', key, 'state', 'delayed', 'ready_at', int_text(due))
end

-- Index entries added during a call, written at its end with one ZADD per index
-- (finish): per-task ZADDs were a large part of a batch's work. Only for indexes the
-- call does not read back meanwhile, except through outcome_of, which flushes first.
local pending_adds, pending_order = {}, {}
local function zadd_later(index, score, member)
  local list = pending_adds[index]
  if list == nil then
    list = {}
    pending_adds[index] = list
    pending_order[#pending_order + 1] = index
  end
  list[#list + 1] = score
  list[#list + 1] = member
end
local function flush_adds()
  for _, index in ipairs(pending_order) do
    local list = pending_adds[index]
    for i = 1, #list, 1000 do
      write('ZADD', index, unpack(list, i, math.min(i + 999, #list)))
    end
  end
  pending_adds, pending_order = {}, {}
end

-- Drop a task record; an explicit id stays reserved in the dedup index, and the last
-- settlement's outcome stays known to a resent acknowledgement for a while. `lease`:
-- owned()'s {extra, state, token, lock_until} when that token settles the task now with
-- `outcome` (text); without them both are read from the record.
local resend_was, resend_text  -- the last resend deadline, and as text
local receipt = nil  -- this call's receipt (use_receipts), where completions are remembered
local function forget(id, key, now, lease, outcome)
  local f = lease
  if f == nil then
    f = redis.call('HMGET', key, 'extra', 'state', 'last_token', 'lock_until', 'last_outcome')
    outcome = f[5]
  end
  if has_extra(key, f[1], 'explicit_id') then
    local reserved_until = now + meta_num('dedup_window_ms', DEFAULTS.dedup_window_ms)
    zadd_later(K_DEDUP, int_text(reserved_until), id)
  end
  local resend_until = (tonumber(f[4]) or 0) + SETTLED_SLACK_MS
  if f[3] and f[3] ~= '' and outcome and resend_until > now then  -- a resend may still come
    if receipt and lease and outcome == '1' then  -- '1': OUTCOME_COMPLETED as text
      receipt.tokens[#receipt.tokens + 1] = f[3]
      if resend_until > receipt.until_ms then receipt.until_ms = resend_until end
    else
      if resend_until ~= resend_was then  -- leases of one call share their deadline
        resend_was, resend_text = resend_until, int_text(resend_until)
      end
      zadd_later(K_SETTLED, resend_text, outcome .. ':' .. f[3])
    end
  end
  write('DEL', key)
end

-- Receipts. A call that completes tasks and deletes their records keeps the tokens it
-- completed in one string, base.."r:"..receipt, until a resend of them can no longer
-- come: one write per call where a settled marker per token cost about a tenth of a
-- worker's call, and expiry drops it where markers cost a sweep each. A call that may be
-- a resend names the receipts of the earlier calls that carried the same settlements.
-- Their keys come last in KEYS: this call's own (`own`, '' = none: completions get
-- settled markers), then those `resent` names (space-separated ids). Returns how many.
local receipt_keys = {}  -- where a settlement of an earlier call may be remembered
local receipt_values = nil  -- their values, read on the first lookup
local function use_receipts(own, resent)
  local ids = {}
  if own ~= '' then ids[1] = own end
  if resent ~= '' then
    for id in string.gmatch(resent, '%S+') do ids[#ids + 1] = id end
  end
  local first = #KEYS - #ids
  for i, id in ipairs(ids) do
    local key = BASE .. 'r:' .. id
    if KEYS[first + i] ~= key then error('undeclared receipt key ' .. key) end
    receipt_keys[i] = key
  end
  if own ~= '' then receipt = {key = receipt_keys[1], tokens = {}, until_ms = 0} end
  return #ids
end

-- Did this call or a receipt it was given complete `token` (and delete its record)?
local function in_receipts(token)
  if receipt then  -- completed by this call already (a token sent twice in it)
    for _, done in ipairs(receipt.tokens) do
      if done == token then return true end
    end
  end
  if receipt_values == nil then
    receipt_values = {}
    for i, key in ipairs(receipt_keys) do receipt_values[i] = redis.call('GET', key) or '' end
  end
  local listed = ' ' .. token .. ' '
  for _, value in ipairs(receipt_values) do
    if string.find(value, listed, 1, true) then return true end
  end
  return false
end

-- A lone completion gets a settled marker instead: less memory and work than a key.
local function keep_receipt()
  if receipt == nil or #receipt.tokens == 0 then return end
  if #receipt.tokens == 1 then
    zadd_later(K_SETTLED, int_text(receipt.until_ms), '1:' .. receipt.tokens[1])  -- OUTCOME_COMPLETED
  else
    write('SET', receipt.key, ' ' .. table.concat(receipt.tokens, ' ') .. ' ', 'PX',
      int_text(math.max(1, receipt.until_ms - now_ms())))
  end
  receipt.tokens = {}
end

-- Remember that `token` settled this task with `outcome`.
local function record_outcome(key, token, outcome)
  write('HSET', key, 'token', '', 'last_token', token, 'last_outcome', outcome)
  settled_here[token] = outcome
end

-- How `token` settled this task (0 = it did not, or it is no longer known).
local function outcome_of(id, token)
  if token == '' then return 0 end
  if settled_here[token] then return settled_here[token] end  -- settled by this call
  local f = redis.call('HMGET', task_key(id), 'last_token', 'last_outcome')
  if f[1] == token then return tonumber(f[2]) or 0 end
  if in_receipts(token) then return OUTCOME_COMPLETED end
  for outcome = OUTCOME_COMPLETED, OUTCOME_RELEASED do
    if redis.call('ZSCORE', K_SETTLED, outcome .. ':' .. token) then return outcome end
  end
  return 0
end

-- A slot under max_active was freed: waiting workers may acquire again.
local function freed_slot()
  if meta_num('max_active', DEFAULTS.max_active) > 0 then wake() end
end

-- ZREM many members (from the `from`th, default the first) without overflowing Lua's
-- stack with unpack().
local function zrem_all(index, members, from)
  for i = from or 1, #members, 1000 do
    write('ZREM', index, unpack(members, i, math.min(i + 999, #members)))
  end
end

-- Does anybody wait on some task? (Read once per call: nothing else adds waiters meanwhile.)
local anybody_waits = nil

-- Move a task into a terminal state and its retention index; wake its waiters, if any
-- (a PUBLISH reaches every node of a cluster: none is sent when nobody waits). `extra`:
-- more field/value pairs for the same HSET; `lease`, `outcome`: as for forget. A record
-- kept for 0 ms is deleted at once, with nothing written to it first.
local function settle(id, key, state, index_key, retention_ms, now, extra, lease, outcome)
  count_settled(state)
  touched[id] = true
  if anybody_waits == nil then anybody_waits = redis.call('EXISTS', K_WAITERS) == 1 end
  if anybody_waits and redis.call('ZSCORE', K_WAITERS, id) then
    write('ZREM', K_WAITERS, id)
    hint('PUBLISH', BASE .. 'done:' .. id, state)
  end
  if retention_ms == 0 then
    forget(id, key, now, lease, outcome)
    return
  end
  local fields = {'state', state, 'finished_at', now_text(), 'token', ''}
  for _, v in ipairs(extra or {}) do fields[#fields + 1] = v end
  write('HSET', key, unpack(fields))
  if retention_ms < 0 then
    zadd_later(index_key, '+inf', id)
  else
    zadd_later(index_key, int_text(now + retention_ms), id)
  end
end

-- The end of every script that settles or forgets tasks: the gathered writes go out.
local function finish(reply)
  keep_receipt()
  flush_adds()
  flush_counts()
  commit()
  return reply
end

-- FIRST_WRITE_FREES. Under maxmemory (noeviction) Redis refuses a command that may grow
-- memory only as a script's first write: later ones go through, or the script would stop
-- half done. The scripts that keep a running attempt alive or settle it (renew, complete,
-- fail, release, acquire's completions) first take the task out of the active index, a
-- write that frees, so a full Redis still lets the work in flight renew and finish, where
-- every attempt used to lose its lease and stall; offers and progress are refused. A
-- worker's announcement and a setting (pause) drop the old entry first, for the same
-- reason, and acquire's naming hint is written with pcall. As functions (Redis 7) the
-- same holds by flags: allow-oom on all but offer and progress, which a full Redis
-- refuses before they run (scripts.REFUSED_WHEN_FULL).

-- Is the caller the current owner, with a lease that has not run out by Redis time?
-- Returns the task key when it is, and {extra, state, token, lock_until (a number)}.
local function owned(id, token, now, key)
  if touched[id] then return nil end  -- this call settled it already
  key = key or task_key(id)
  local st = redis.call('HMGET', key, 'extra', 'state', 'token', 'lock_until')
  if st[2] == 'active' and st[3] == token and token ~= '' then
    local lock_until = tonumber(st[4])
    if lock_until and lock_until >= now then
      st[4] = lock_until
      return key, st
    end
  end
  return nil
end

local function drop_from_indexes(id, state)
  local index = ({waiting = K_WAITING, delayed = K_DELAYED, active = K_ACTIVE, completed = K_COMPLETED,
    failed = K_FAILED, canceled = K_CANCELED})[state]
  if index then write('ZREM', index, id) end
end

-- Move a declared delayed task into waiting if it is due; true when it was.
local function promote_if_due(id, now)
  local due = redis.call('ZSCORE', K_DELAYED, id)
  if not due or tonumber(due) > now then return false end
  write('ZREM', K_DELAYED, id)
  promoted_here = promoted_here + 1
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
  if promoted_here == 0 or at > now_ms() then return at end
  -- This call promoted some of the due ones (their removal is still queued): the next
  -- due is now when others are due too, else the first one after now.
  if redis.call('ZCOUNT', K_DELAYED, '-inf', now_text()) > promoted_here then return at end
  first = redis.call('ZRANGE', K_DELAYED, '(' .. now_text(), '+inf', 'BYSCORE', 'LIMIT', '0', '1', 'WITHSCORES')
  if first[2] then return tonumber(first[2]) end
  return -1
end

-- Settle owned tasks as completed: the records from ARGV[first] on, 3 values each (id,
-- token, result JSON). Returns their outcomes (protocol.Outcome) and how many completed.
local function complete_each(first, retention)
  local now = now_ms()
  local outcomes, done = {}, {}
  for i = first, #ARGV, 3 do
    local id, token = ARGV[i], ARGV[i + 1]
    local key, st = owned(id, token, now, KEYS[QUEUE_KEYS + (i - first) / 3 + 1])
    if key then
      done[#done + 1] = id
      if #done == 1 then write('ZREM', K_ACTIVE, id) end  -- the first write frees (FIRST_WRITE_FREES)
      emit('completed', id)
      local kept = nil  -- the fields of a record that is kept (built only then)
      if retention ~= 0 then
        kept = {'result', ARGV[i + 2], 'last_token', token, 'last_outcome', OUTCOME_COMPLETED}
      end
      settle(id, key, 'completed', K_COMPLETED, retention, now, kept, st, '1')  -- '1': OUTCOME_COMPLETED as text
      settled_here[token] = OUTCOME_COMPLETED
      outcomes[#outcomes + 1] = OUTCOME_COMPLETED
    else
      outcomes[#outcomes + 1] = outcome_of(id, token)
    end
  end
  if #done > 0 then
    zrem_all(K_ACTIVE, done, 2)  -- the first left already
    freed_slot()
  end
  return outcomes, #done
end

-- The live workers of the queue: {name, in_flight, concurrency, ...} (protocol.WorkersReply).
-- `drop`: remove the entries past their expiry (a write, so announcements only: a listing
-- must run on a read-only replica, where the dashboard may read).
local function live_workers(now, drop, own, own_entry)
  local out = {}
  local function add(name, entry)
    local in_flight, concurrency, expires = string.match(entry, '(%S+) (%S+) (%S+)')
    if tonumber(expires) and tonumber(expires) >= now then
      out[#out + 1] = name
      out[#out + 1] = tonumber(in_flight)
      out[#out + 1] = tonumber(concurrency)
      return true
    end
    return false
  end
  local all = redis.call('HGETALL', K_WORKERS)
  for i = 1, #all, 2 do
    if all[i] ~= own and not add(all[i], all[i + 1]) and drop then
      write('HDEL', K_WORKERS, all[i])
    end
  end
  if own_entry then add(own, own_entry) end
  return out
end
