--[[ maintain: bounded sweeps by Redis time, over the declared tasks and the queue's own
indexes.
KEYS: the queue keys of keys.lua, then candidates: the task hashes of ids the caller read
  first, at most `batch` from each of active, delayed, completed, failed and canceled
  (their lowest scores); each is checked here again by Redis time.
ARGV[1] batch              the sweeps of dedup, settled and waiters remove at most this many each
ARGV[2] max_stalled_count  the default (task option, then meta max_stalled_count, then this)
ARGV[3] stalled_error      JSON, tag ~effectmq/Error/Stalled: the error of a task that stalled too often
ARGV[4] retention_ms       for failed records (meta retention_failed_ms wins; -1 = keep)
ARGV[5] retried_stall      JSON, tag ~effectmq/Error/Stalled: a stall's entry in the history when
  the task goes back to waiting
A candidate that is due: an expired lease is a stall (counted; the task goes back to
waiting or fails), a delayed task is promoted, a terminal record past its retention is
forgotten; any other candidate is left alone.
Returns: {recovered, stalled_failed, promoted, expired_records, expired_reservations, more}
  (expired_reservations also counts remembered settlements and waiters that ended)
  more = 1 when a sweep of dedup, settled or waiters was cut short by its batch; the
  caller adds its own reads that were (call again soon).
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
local now = now_ms()
local batch = tonumber(ARGV[1])
local more = 0
local recovered, dead, promoted, forgotten = 0, 0, 0, 0
local ready = {}  -- ids the wake message names
local candidates = declared_ids()
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
      local stalls = (tonumber(redis.call('HGET', key, 'stalled_attempt_count')) or 0) + 1
      local limit = task_option(key, 'max_stalled_count', 'max_stalled_count', ARGV[2])
      write('HSET', key, 'token', '', 'stalled_attempt_count', int_text(stalls))
      record_attempt(key, 'stalled', stalls > limit and stalled_error or retried_stall, now)
      if stalls > limit then
        write('HSET', key, 'error', stalled_error)
        emit('failed', id, 'kind', 'stall', 'retry_at', -1)
        settle(id, key, 'failed', K_FAILED, meta_num('retention_failed_ms', ARGV[4]), now)
        dead = dead + 1
      else
        emit('stalled', id, 'stalled_attempt_count', stalls)
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
    for _, index in ipairs({K_COMPLETED, K_FAILED, K_CANCELED}) do
      if due_in(index, id) then
        write('ZREM', index, id)
        forget(id, key, now)
        forgotten = forgotten + 1
        break
      end
    end
  end
end
if #ready > 0 then wake(ready) elseif dead > 0 then freed_slot() end

return finish({recovered, dead, promoted, forgotten, ended, more})
