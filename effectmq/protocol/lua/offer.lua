--[[ offer: add one or more tasks; an id that exists (or is still reserved) is left untouched.
KEYS: the queue keys of keys.lua, then the task hash of each record's id, in order.
ARGV[1] count  the number of tasks
ARGV[2] nonce  random per call (a positive integer), stored as explicit_id of the tasks
  with explicit ids it creates: a resend of the call (its reply lost) finds them as its own
ARGV[3...] tasks...: 11 values each: id, explicit_id, name, payload, delay_ms, priority,
  max_retries, max_stalled_count, options, trace, group
  explicit_id: 1 | 0; payload: JSON; max_retries, max_stalled_count: -1 = queue default
  options: JSON object of further per-task options (retry policy, timeout), or ''
  trace: the task's creation context (a JSON object of trace propagation fields), or ''
  group: the task's group (groups.lua: fair turns between groups), or '' for none
Returns: {created...}  one per task: 1 = created (by this call, or by its first send),
  0 = already known (idempotent re-offer, or the same id earlier in this call)
]]
--- @include "keys"
--- @include "time"
--- @include "writes"
--- @include "extras"
--- @include "events"
--- @include "wake"
--- @include "indexes"
--- @include "groups"
local now = now_ms()
local n = tonumber(ARGV[1])
local nonce = ARGV[2]
local created = {}
local woke = false
local ready = {}  -- ids the wake message names (and that join the waiting index)
local ready_prio, ready_group = {}, {}
local later = {}  -- due time, id pairs for the delayed index
local first_due = nil  -- the first due delayed task's time, read on the first delayed offer
local fields, extra  -- of the task being created
local created_here = {}  -- ids this call creates: the same id again in it is a re-offer
local function keep(field, value)  -- an optional field, and its letter in `extra`
  fields[#fields + 1] = field
  fields[#fields + 1] = value
  extra = extra .. EXTRA_LETTER[field]
end
for i = 0, n - 1 do
  local b = 3 + i * 11
  local id = ARGV[b]
  local key = task_key(id)
  -- A generated id exists only when this call's first send created it (its reply lost);
  -- an explicit one keeps the nonce of the call that created it, and may be reserved.
  local explicit = ARGV[b + 1] == '1'
  local f = redis.call('HMGET', key, 'state', 'explicit_id')  -- every record has a state
  local reserved = explicit and not f[1] and redis.call('ZSCORE', K_DEDUP, id)
  if created_here[id] then
    created[#created + 1] = 0  -- the same id earlier in this call: stored once, as that one asked
  elseif f[1] or (reserved and tonumber(reserved) > now) then
    created[#created + 1] = f[1] and (not explicit or f[2] == nonce) and 1 or 0
  else
    created_here[id] = true
    local delay = tonumber(ARGV[b + 4]) or 0
    local state = delay > 0 and 'delayed' or 'waiting'
    -- Optional fields at their defaults are left out (readers default them): a smaller
    -- hash is less memory, and cheaper for every later read and write of it. `extra`
    -- says which are there (EXTRA_LETTER), so that readers need not look for the others.
    -- The fields read on every lease and settlement come first: a hash of this size is a
    -- list that a lookup walks from its start.
    fields = {'extra', '', 'state', state, 'attempt', '0', 'handler_failure_count', '0',
      'stalled_attempt_count', '0', 'name', ARGV[b + 2], 'payload', ARGV[b + 3], 'created_at', now_text()}
    if delay > 0 then  -- ready_at is created_at until they differ
      fields[#fields + 1] = 'ready_at'
      fields[#fields + 1] = int_text(now + delay)
    end
    extra = ''
    if explicit then keep('explicit_id', nonce) end
    if ARGV[b + 5] ~= '0' then keep('priority', ARGV[b + 5]) end
    if ARGV[b + 6] ~= '-1' then keep('max_retries', ARGV[b + 6]) end
    if ARGV[b + 7] ~= '-1' then keep('max_stalled_count', ARGV[b + 7]) end
    if ARGV[b + 8] ~= '' then keep('options', ARGV[b + 8]) end
    if ARGV[b + 9] ~= '' then keep('trace', ARGV[b + 9]) end
    if ARGV[b + 10] ~= '' then keep('group', ARGV[b + 10]) end
    fields[2] = extra
    write('HSET', key, unpack(fields))
    if delay > 0 then
      later[#later + 1] = int_text(now + delay)
      later[#later + 1] = id
      if first_due == nil then first_due = next_due() end
      if first_due < 0 or now + delay < first_due then
        first_due = now + delay
        woke = true  -- a sleeping worker's next look must come sooner
      end
    else
      ready[#ready + 1] = id
      ready_prio[#ready] = tonumber(ARGV[b + 5]) or 0
      ready_group[#ready] = ARGV[b + 10]
      woke = true
    end
    emit('created', id, 'name', ARGV[b + 2])
    created[#created + 1] = 1
  end
end
local grouped = false  -- does a task of this call, or one waiting, have a group?
for i = 1, #ready do if ready_group[i] ~= '' then grouped = true end end
if #ready > 0 and not grouped then grouped = groups_waiting() end
if #ready > 0 then  -- FIFO within a priority band: sequence numbers in offer order
  local entries = {}
  if grouped then  -- each group's turns (groups.lua)
    for i, id in ipairs(ready) do
      ready_prio[i] = (-ready_prio[i]) * PRIORITY_SPAN + waiting_seq(ready_group[i], ready_prio[i])  -- now its score
      entries[#entries + 1] = int_text(ready_prio[i])
      entries[#entries + 1] = id
      group_entered(ready_group[i])
    end
  else
    local seq = take_seq(#ready) - 1
    for i, id in ipairs(ready) do
      entries[#entries + 1] = int_text((-ready_prio[i]) * PRIORITY_SPAN + seq + i)
      entries[#entries + 1] = id
    end
  end
  for i = 1, #entries, 1000 do
    write('ZADD', K_WAITING, unpack(entries, i, math.min(i + 999, #entries)))
  end
end
for i = 1, #later, 1000 do
  write('ZADD', K_DELAYED, unpack(later, i, math.min(i + 999, #later)))
end
if woke and grouped then
  wake_groups(ready, ready_prio)
elseif woke then
  wake(ready)
end
commit()
return created
