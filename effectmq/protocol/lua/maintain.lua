--[[ maintain: bounded sweeps by Redis time, over the declared tasks and the queue's own
indexes.
KEYS: the queue keys of keys.lua, then candidates: the task hashes of ids the caller read
  first, at most `batch` from each of active, delayed, completed, failed and canceled
  (their lowest scores), and a few of the poison set; each is checked here again by Redis
  time.
ARGV[1] batch              the sweeps of dedup, settled and waiters remove at most this many each
ARGV[2] max_stalled_count  the default (task option, then meta max_stalled_count, then this)
ARGV[3] stalled_error      JSON, tag ~effectmq/Error/Stalled: the error of a task that stalled too often
ARGV[4] retention_ms       for failed records (meta retention_failed_ms wins; -1 = keep)
ARGV[5] retried_stall      JSON, tag ~effectmq/Error/Stalled: a stall's entry in the history when
  the task goes back to waiting
ARGV[6] lock_timeout_ms    the lease length a stall's heartbeat age assumes (meta lock_timeout_ms wins)
ARGV[7] poison_kept        the poison set keeps at most this many ids
ARGV[8] poison_kills       stalls that killed the pod after which a task is poison
Last KEYS: pods, endings, stall_minutes, poison, group_ctl, backlog
  (group_ctl and backlog only once the caller knows the queue counts its groups: group_caps.lua)
A candidate that is due: an expired lease is a stall (counted; the task goes back to
waiting or fails), a delayed task is promoted, a terminal record past its retention is
forgotten (and leaves the poison set), a poison id without a record leaves it; any other
candidate is left alone.
A stall's history entry gets its `cause` (forensics.lua): how the pod of the worker
process that held the lease ended, {kind, pod, node, exit_code, message}, or {kind:
"unknown", heartbeat_age_ms[, pod, node]}, where heartbeat_age_ms = now - (lock_until -
lease length): the last renewal set lock_until to its time plus the lease length (the
queue's lock_timeout_ms, else ARGV[6]). Stalls are counted per minute by cause; a task
whose stalls killed its worker's pod (forensics.pod_died) poison_kills times (its field
pod_kills) joins the poison set, unless its record goes at once (retention 0).
Returns: {recovered, stalled_failed, promoted, expired_records, expired_reservations, more, stalls...}
  (expired_reservations also counts remembered settlements and waiters that ended)
  more = 1 when a sweep of dedup, settled or waiters was cut short by its batch; the
  caller adds its own reads that were (call again soon).
stalls...: 8 values each: id, attempt, stalled_attempt_count, failed, trace, cause, pod, node
  one per stall counted here: the attempt that stalled, the task's stall count now,
  failed = 1 when that count passed its max_stalled_count (else the task waits again),
  trace: its creation context (false: none), cause: its kind (protocol.STALL_CAUSES),
  pod and node: of the worker that held the lease ('' unknown)
]]
--- @include "call"
--- @include "keys"
--- @include "time"
--- @include "writes"
--- @include "meta"
--- @include "events"
--- @include "history"
--- @include "wake"
--- @include "indexes"
--- @include "settle"
--- @include "counts"
--- @include "forensics"
--- @include "group_caps"
local group_keys = group_key_count()
if not group_keys then return group_keys_refused() end
local poison_kills = tonumber(ARGV[8]) or math.huge
local now = now_ms()
local last_parts = {'pods', 'endings', 'stall_minutes', 'poison', 'group_ctl', 'backlog'}
if group_keys == 0 then last_parts[6], last_parts[5] = nil, nil end
local forensic = declared_last(last_parts)  -- and the group keys (group_caps.lua)
use_caps(forensic)
local batch = tonumber(ARGV[1])
local more = 0
local recovered, dead, promoted, forgotten = 0, 0, 0, 0
local stalls = {}  -- the reply's stall records (after its counts)
local ready = {}  -- ids the wake message names
local candidates = declared_ids(0, #last_parts)  -- the forensic and group keys come last
local stalled_error = stored_error(ARGV[3], 'stall')
local retried_stall = stored_error(ARGV[5], 'stall')

-- Is `id` in `index` with a score that is due by now?
local function due_in(index, id)
  local score = redis.call('ZSCORE', index, id)
  return score and tonumber(score) <= now
end

-- Reserved ids whose dedup window ended, remembered settlements and waiters past their time
-- (first: the ranks read here are those its queued removal finds).
local ended = 0
-- Removed by rank or score, not read: their members are not needed here.
for _, index in ipairs({K_DEDUP, K_SETTLED, K_WAITERS}) do
  local due = redis.call('ZCOUNT', index, '-inf', now_text())
  if due >= batch then
    more = 1
    write('ZREMRANGEBYRANK', index, '0', int_text(batch - 1))  -- the lowest scores: all due
    ended = ended + batch
  elseif due > 0 then
    write('ZREMRANGEBYSCORE', index, '-inf', now_text())
    ended = ended + due
  end
end

for _, id in ipairs(candidates) do
  local key = task_key(id)
  if due_in(K_ACTIVE, id) then
    -- An expired lease: the attempt stalled; count it and hand the task back or end it.
    write('ZREM', K_ACTIVE, id)
    call.touched[id] = true
    if redis.call('EXISTS', key) == 1 then
      local f = redis.call('HMGET', key, 'stalled_attempt_count', 'attempt', 'trace', 'token', 'lock_until', 'pod_kills',
        'group')
      slot_freed(key, nil, f[4], f[7] or '')  -- its group's slot (group_caps.lua)
      local count = (tonumber(f[1]) or 0) + 1
      local limit = task_option(key, 'max_stalled_count', 'max_stalled_count', ARGV[2])
      local cause, kind, pod, node = stall_cause(forensic, f[4], f[5], meta_num('lock_timeout_ms', ARGV[6]), now)
      count_stall(kind)
      local kills = tonumber(f[6]) or 0
      if pod_died(kind) then kills = kills + 1 end
      local retention = count > limit and meta_num('retention_failed_ms', ARGV[4])
      write('HSET', key, 'token', '', 'stalled_attempt_count', int_text(count))
      if pod_died(kind) then write('HSET', key, 'pod_kills', int_text(kills)) end
      record_attempt(key, 'stalled', count > limit and stalled_error or retried_stall, now, cause)
      if kills >= poison_kills and retention ~= 0 then
        write('ZADD', forensic.poison, now_text(), id)
        write('ZREMRANGEBYRANK', forensic.poison, '0', int_text(-1 - (tonumber(ARGV[7]) or 0)))
      elseif kills >= poison_kills then
        write('ZREM', forensic.poison, id)
      end
      local n = #stalls
      stalls[n + 1], stalls[n + 2], stalls[n + 3] = id, tonumber(f[2]) or 0, count
      stalls[n + 4], stalls[n + 5] = count > limit and 1 or 0, f[3]
      stalls[n + 6], stalls[n + 7], stalls[n + 8] = kind, pod, node
      if count > limit then
        write('HSET', key, 'error', stalled_error)
        emit('failed', id, 'kind', 'stall', 'retry_at', -1)
        settle(id, key, 'failed', K_FAILED, retention, now)
        dead = dead + 1
      else
        emit('stalled', id, 'stalled_attempt_count', count)
        enqueue_waiting(id, key, now)
        ready[#ready + 1] = id
        recovered = recovered + 1
      end
    end
  elseif promote_if_due(id, now) then
    ready[#ready + 1] = id
    promoted = promoted + 1
  else
    -- A terminal record past its retention.
    local swept = false
    for _, index in ipairs({K_COMPLETED, K_FAILED, K_CANCELED}) do
      if due_in(index, id) then
        write('ZREM', index, id)
        write('ZREM', forensic.poison, id)
        forget(id, key, now)
        forgotten = forgotten + 1
        swept = true
        break
      end
    end
    -- A poison id whose record another script deleted (one kept for 0 s).
    if not swept and redis.call('EXISTS', key) == 0 and redis.call('ZSCORE', forensic.poison, id) then
      write('ZREM', forensic.poison, id)
    end
  end
end
if #ready > 0 then wake(ready) elseif dead > 0 then freed_slot() end
flush_stall_counts(forensic.stall_minutes, MINUTE_SLOTS)

local out = {recovered, dead, promoted, forgotten, ended, more}
for i = 1, #stalls do out[6 + i] = stalls[i] end
return finish(out)
