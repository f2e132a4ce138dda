--[[ offer: add one or more tasks; an id that exists (or is still reserved) is left untouched.
KEYS: the queue keys of lib.lua, then the task hash of each record's id, in order.
ARGV[1] count  the number of tasks
ARGV[2...] tasks...: 9 values each: id, explicit_id, name, payload, delay_ms, priority,
  max_retries, max_stalled_count, options
  explicit_id: 1 | 0; payload: JSON; max_retries, max_stalled_count: -1 = queue default
  options: JSON object of further per-task options (retry policy, timeout), or ''
Returns: {created...}  one per task: 1 = created, 0 = already known (idempotent re-offer)
]]
local now = now_ms()
local n = tonumber(ARGV[1])
local created = {}
local woke = false
local ready = {}  -- ids the wake message names
local first_due = next_due()
for i = 0, n - 1 do
  local b = 2 + i * 9
  local id = ARGV[b]
  local key = task_key(id)
  local reserved = redis.call('ZSCORE', K_DEDUP, id)
  if redis.call('EXISTS', key) == 1 or (reserved and tonumber(reserved) > now) then
    created[#created + 1] = 0
  else
    local delay = tonumber(ARGV[b + 4])
    redis.call('HSET', key,
      'name', ARGV[b + 2], 'payload', ARGV[b + 3], 'explicit_id', ARGV[b + 1],
      'priority', ARGV[b + 5], 'max_retries', ARGV[b + 6], 'max_stalled_count', ARGV[b + 7],
      'options', ARGV[b + 8], 'attempt', 0, 'handler_failure_count', 0,
      'stalled_attempt_count', 0, 'created_at', now, 'token', '')
    if delay > 0 then
      enqueue_delayed(id, key, now + delay)
      if first_due < 0 or now + delay < first_due then
        first_due = now + delay
        woke = true  -- a sleeping worker's next look must come sooner
      end
    else
      enqueue_waiting(id, key, now)
      ready[#ready + 1] = id
      woke = true
    end
    emit('created', id, 'name', ARGV[b + 2])
    created[#created + 1] = 1
  end
end
if woke then wake(ready) end
return created
