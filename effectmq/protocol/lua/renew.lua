--[[ renew: extend the leases the caller still owns.
KEYS: the queue keys of keys.lua, then the task hash of each record's id, in order.
ARGV[1] lock_timeout_ms  the queue's meta lock_timeout_ms wins when set
ARGV[2...] leases...: 2 values each: id, token
Returns: {now, deadline, owned...}  owned: 1 (renewed) or 0 (lease lost) per lease
]]
--- @include "keys"
--- @include "time"
--- @include "writes"
--- @include "meta"
--- @include "indexes"
--- @include "leases"
local now = now_ms()
local deadline = now + meta_num('lock_timeout_ms', ARGV[1])
local out = {now, deadline}
local deadline_text = int_text(deadline)
local ids, keys = {}, {}  -- of the leases still owned
for i = 2, #ARGV, 2 do
  local key = owned(ARGV[i], ARGV[i + 1], now)
  if key then
    ids[#ids + 1], keys[#keys + 1] = ARGV[i], key
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
-- They leave the active index first and come back with the new deadline (FIRST_WRITE_FREES).
zrem_all(K_ACTIVE, ids)
for j, key in ipairs(keys) do
  write('HSET', key, 'lock_until', deadline_text)
  zadd_later(K_ACTIVE, deadline_text, ids[j])
end
flush_adds()
commit()
return out
