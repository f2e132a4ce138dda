--[[ keys.lua: the queue's keys, as every script receives them, and the task hashes a call declares.

Every script receives the same queue-level KEYS first (all share the queue's hash tag):
  KEYS[1]  base        "{emq:<queue>}:"  a prefix, never read or written: task hashes are
                                          base.."t:"..id, channels base.."wake" and
                                          base.."done:"..id
  KEYS[2]  waiting     zset, score = -priority * 2^40 + seq (FIFO within priority;
                       a grouped task's seq is its group's virtual time: groups.lua)
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
  KEYS[16] peeked      string "token_prefix score" (or "score"): the score of the last
                       waiting id an acquire reply named, so that the next caller is
                       named the ids after it (acquire.lua)
  KEYS[17] groups      zset of task groups with waiting tasks: group -> how many (groups.lua)
  KEYS[18] group_clock hash of the groups' virtual times: group -> the last sequence number
                       one of its tasks took in waiting (groups.lua)
After them (KEYS[19...]) come the task hashes the call touches, then the receipts it
writes or reads (base.."r:"..receipt, see use_receipts), then the queue keys that only a
few scripts touch (pods, endings, stall_minutes, poison: see forensics.lua; starts: the log
of a rate limit's starts, see acquire.lua; group_ctl, backlog: a group's cap, pause and
parked tasks, see group_caps.lua; declared_last below; a header names them in its "Last
KEYS" line), and a script touches no other task hash: every key is declared before the call, as Redis Cluster and proxies that
route on KEYS require. task_key(id) gives only a declared key and raises
"ERR undeclared task key" otherwise, so a script cannot break the rule unnoticed. The
caller knows the ids first: they are its arguments (offer, settle, cancel, ...), or ids an
earlier reply, a wake message or the caller's own offers named (acquire), or ids read
with plain commands (maintain); the script checks each again, by Redis time.
All times come from Redis TIME, in milliseconds.
]]
--- @include "call"

local BASE = KEYS[1]
local K_WAITING, K_DELAYED, K_ACTIVE = KEYS[2], KEYS[3], KEYS[4]
local K_COMPLETED, K_FAILED, K_CANCELED = KEYS[5], KEYS[6], KEYS[7]
local K_DEDUP, K_META, K_EVENTS, K_SEQ, K_MINUTES = KEYS[8], KEYS[9], KEYS[10], KEYS[11], KEYS[12]
local K_WORKERS, K_SETTLED, K_WAITERS, K_PEEKED = KEYS[13], KEYS[14], KEYS[15], KEYS[16]
local K_GROUPS, K_GROUP_CLOCK = KEYS[17], KEYS[18]
local QUEUE_KEYS = 18  -- KEYS after these are task hashes
local PRIORITY_SPAN = 1099511627776 -- 2^40 sequence numbers per priority band
local TASK_PREFIX = BASE .. 't:'

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

-- The task hash of `id`, which the caller must have declared in KEYS.
local function task_key(id)
  local key = TASK_PREFIX .. id
  if call.declared == nil then
    call.declared = {}
    for i = QUEUE_KEYS + 1, #KEYS do call.declared[KEYS[i]] = true end
  end
  if not call.declared[key] then error('undeclared task key ' .. key) end  -- a string: 6.2 cannot raise a table
  return key
end

-- The queue keys named in `parts`, which the caller declared last, in this order: by part.
local function declared_last(parts)
  local keys, first = {}, #KEYS - #parts
  for i, part in ipairs(parts) do
    local key = BASE .. part
    if KEYS[first + i] ~= key then error('undeclared queue key ' .. key) end
    keys[part] = key
  end
  return keys
end
