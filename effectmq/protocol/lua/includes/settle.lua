-- settle.lua: terminal states, retention and forgetting a record; the end of every settling script.
--- @include "call"
--- @include "keys"
--- @include "writes"
--- @include "extras"
--- @include "outcomes"
--- @include "indexes"
--- @include "time"
--- @include "meta"
--- @include "counts"
--- @include "receipts"

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
    if call.receipt and lease and outcome == '1' then  -- '1': OUTCOME_COMPLETED as text
      call.receipt.tokens[#call.receipt.tokens + 1] = f[3]
      if resend_until > call.receipt.until_ms then call.receipt.until_ms = resend_until end
    else
      if resend_until ~= call.resend_was then  -- leases of one call share their deadline
        call.resend_was, call.resend_text = resend_until, int_text(resend_until)
      end
      zadd_later(K_SETTLED, call.resend_text, outcome .. ':' .. f[3])
    end
  end
  write('DEL', key)
end

-- Move a task into a terminal state and its retention index; wake its waiters, if any
-- (a PUBLISH reaches every node of a cluster: none is sent when nobody waits). `extra`:
-- more field/value pairs for the same HSET; `lease`, `outcome`: as for forget. A record
-- kept for 0 ms is deleted at once, with nothing written to it first.
local function settle(id, key, state, index_key, retention_ms, now, extra, lease, outcome)
  count_settled(state)
  call.touched[id] = true
  if call.anybody_waits == nil then call.anybody_waits = redis.call('EXISTS', K_WAITERS) == 1 end
  if call.anybody_waits and redis.call('ZSCORE', K_WAITERS, id) then
    write('ZREM', K_WAITERS, id)
    hint('PUBLISH', BASE .. 'done:' .. id, state)
  end
  if retention_ms == 0 then
    forget(id, key, now, lease, outcome)
    return
  end
  local command = {'HSET', key, 'state', state, 'finished_at', now_text(), 'token', ''}
  for _, v in ipairs(extra or {}) do command[#command + 1] = v end
  write_command(command)
  if retention_ms < 0 then
    zadd_later(index_key, '+inf', id)
  else
    zadd_later(index_key, int_text(now + retention_ms), id)
  end
end

-- What a script that settles or forgets tasks gathered, written: its receipt, the index
-- entries, the per-minute counts, then every queued write (acquire writes its leases after).
local function write_gathered()
  keep_receipt()
  flush_adds()
  flush_counts()
  commit_writes()
end

-- The end of every script that settles or forgets tasks: the gathered writes go out, then the hints.
local function finish(reply)
  write_gathered()
  send_hints()
  return reply
end
