-- leases.lua: lease ownership and completions.
--- @include "call"
--- @include "keys"
--- @include "writes"
--- @include "outcomes"
--- @include "indexes"
--- @include "time"
--- @include "events"
--- @include "wake"
--- @include "settle"

-- Is the caller the current owner, with a lease that has not run out by Redis time?
-- Returns the task key when it is, and {extra, state, token, lock_until (a number)}.
local function owned(id, token, now, key)
  if call.touched[id] then return nil end  -- this call settled it already
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
      if call.caps then call.caps.freed(key, st[1], token) end  -- its group's slot (group_caps.lua)
      local kept = nil  -- the fields of a record that is kept (built only then)
      if retention ~= 0 then
        kept = {'result', ARGV[i + 2], 'last_token', token, 'last_outcome', OUTCOME_COMPLETED}
      end
      settle(id, key, 'completed', K_COMPLETED, retention, now, kept, st, '1')  -- '1': OUTCOME_COMPLETED as text
      call.settled[token] = OUTCOME_COMPLETED
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
