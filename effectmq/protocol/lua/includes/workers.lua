-- workers.lua: the live workers of the queue.
--- @include "keys"
--- @include "writes"

-- The live workers of the queue: {name, in_flight, concurrency, ...} (protocol.WorkersReply).
-- `drop`: remove the entries past their expiry (a write, so the workers script only: a
-- listing must run on a read-only replica, where the dashboard may read).
local function live_workers(now, drop)
  local out = {}
  local all = redis.call('HGETALL', K_WORKERS)
  for i = 1, #all, 2 do
    local in_flight, concurrency, expires = string.match(all[i + 1], '(%S+) (%S+) (%S+)')
    if tonumber(expires) and tonumber(expires) >= now then
      out[#out + 1] = all[i]
      out[#out + 1] = tonumber(in_flight)
      out[#out + 1] = tonumber(concurrency)
    elseif drop then
      write('HDEL', K_WORKERS, all[i])
    end
  end
  return out
end
