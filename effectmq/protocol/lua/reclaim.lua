--[[ reclaim: hand back the leases of an acquire call whose reply never arrived: nobody
runs them, so each declared task still active under a token of that call goes back to
waiting as if it had not been leased (its attempt not counted, no stall). Leases of
other calls, and tasks settled meanwhile, are left alone.
KEYS: the queue keys of keys.lua, then ids: the task hashes of ids the lost call declared.
ARGV[1] token_prefix  the lost call's token prefix (its tokens are token_prefix..":"..seq)
Returns: reclaimed  how many tasks went back to waiting
]]
--- @include "keys"
--- @include "time"
--- @include "writes"
--- @include "wake"
--- @include "indexes"
if ARGV[1] == '' then return 0 end
local prefix = ARGV[1] .. ':'
local now = now_ms()
local ids, keys, attempts = {}, {}, {}
for _, id in ipairs(declared_ids()) do
  local key = task_key(id)
  local f = redis.call('HMGET', key, 'state', 'token', 'attempt')
  if f[1] == 'active' and f[2] and string.sub(f[2], 1, #prefix) == prefix then
    local n = #ids + 1
    ids[n], keys[n] = id, key
    attempts[n] = int_text(math.max(0, (tonumber(f[3]) or 1) - 1))
  end
end
if #ids == 0 then return 0 end
-- The first write frees (FIRST_WRITE_FREES).
zrem_all(K_ACTIVE, ids)
for i, id in ipairs(ids) do
  write('HSET', keys[i], 'token', '', 'attempt', attempts[i])
  enqueue_waiting(id, keys[i], now)
end
wake(ids)
commit()
return #ids
