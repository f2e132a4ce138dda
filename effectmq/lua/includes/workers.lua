-- workers.lua: the live workers of the queue.
--- @include "keys"
--- @include "writes"

-- The live workers of the queue: {name, in_flight, concurrency, ...} (protocol.WorkersReply).
-- `drop`: remove the entries past their expiry (a write, so announcements only: a listing
-- must run on a read-only replica, where the dashboard may read).
local function live_workers(now, drop, own, own_entry)
  local out = {}
  local function add(name, entry)
    local in_flight, concurrency, expires = string.match(entry, '(%S+) (%S+) (%S+)')
    if tonumber(expires) and tonumber(expires) >= now then
      out[#out + 1] = name
      out[#out + 1] = tonumber(in_flight)
      out[#out + 1] = tonumber(concurrency)
      return true
    end
    return false
  end
  local all = redis.call('HGETALL', K_WORKERS)
  for i = 1, #all, 2 do
    if all[i] ~= own and not add(all[i], all[i + 1]) and drop then
      write('HDEL', K_WORKERS, all[i])
    end
  end
  if own_entry then add(own, own_entry) end
  return out
end
