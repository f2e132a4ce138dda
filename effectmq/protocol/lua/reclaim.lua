--[[ reclaim: hand back the leases of an acquire call whose reply never arrived: nobody
runs them, so each declared task still active under a token of that call goes back to
waiting as if it had not been leased (its attempt not counted, no stall). Leases of
other calls, and tasks settled meanwhile, are left alone.
KEYS: the queue keys of keys.lua, then ids: the task hashes of ids the lost call declared.
ARGV[1] token_prefix  the lost call's token prefix (its tokens are token_prefix..":"..seq)
Last KEYS: group_ctl, backlog
  (only once the caller knows the queue counts its groups: group_caps.lua group_key_count)
Returns: reclaimed  how many tasks went back to waiting
]]
--- @include "keys"
--- @include "time"
--- @include "writes"
--- @include "wake"
--- @include "indexes"
--- @include "group_caps"
local group_keys = group_key_count()
if not group_keys then return group_keys_refused() end
if ARGV[1] == '' then return 0 end
local prefix = ARGV[1] .. ':'
local now = now_ms()
local ids, keys, attempts = {}, {}, {}
if caps_from() then use_caps(declared_last({'group_ctl', 'backlog'})) end  -- slots freed (group_caps.lua)
for _, id in ipairs(declared_ids(0, group_keys)) do
  local key = task_key(id)
  local f = redis.call('HMGET', key, 'state', 'token', 'attempt', 'group')
  if f[1] == 'active' and f[2] and string.sub(f[2], 1, #prefix) == prefix then
    local n = #ids + 1
    ids[n], keys[n] = id, key
    attempts[n] = int_text(math.max(0, (tonumber(f[3]) or 1) - 1))
    slot_freed(key, nil, f[2], f[4] or '')
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
