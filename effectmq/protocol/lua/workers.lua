--[[ workers: record this worker's load; with no name, list the live workers of the queue
(dropping the entries past their expiry; live_workers.lua only lists).
KEYS: the queue keys of keys.lua.
ARGV[1] name         empty: only list (as versions before live_workers.lua did)
ARGV[2] in_flight    -1: the worker is leaving
ARGV[3] concurrency
ARGV[4] ttl_ms       how long the entry stays live without news
ARGV[5] token_prefix the worker's lease tokens' prefix ('' = no pod identity: nothing more)
ARGV[6] pod          the worker's pod name, ARGV[7] uid its uid, ARGV[8] node its node ('' = unknown)
ARGV[9] pod_retention_ms  an entry of the pods hash not announced for this long is dropped
Last KEYS: pods
With a pod identity the announcement also writes token_prefix -> the pod (forensics.lua),
keeping the since_ms of the process's first announcement, also when it leaves: a stall of
its leases is found after it is gone.
Returns: {workers...}  a listing's live workers; an announcement lists none. It looks at
  two other entries, at random, and drops those past their expiry: O(1) per announcement,
  where reading every entry made the announcements of W workers cost O(W^2). The hash holds
  one entry per worker process, so an entry left a while longer loses nothing.
workers...: 3 values each: name, in_flight, concurrency
]]
--- @include "keys"
--- @include "time"
--- @include "writes"
--- @include "workers"
--- @include "forensics"
local SWEPT_PER_ANNOUNCEMENT = 2
local now = now_ms()
local pods = declared_last({'pods'}).pods
if ARGV[1] == '' then
  local out = live_workers(now, true)
  commit()
  return out
end
local others = redis.call('HRANDFIELD', K_WORKERS, SWEPT_PER_ANNOUNCEMENT, 'WITHVALUES')
local prefix, announced, gone = ARGV[5], nil, {}
if prefix ~= '' then
  if #prefix > 64 or not string.find(prefix, '^[%w]+$') or not k8s_name(ARGV[6], false) or
      not k8s_name(ARGV[7], false) or not k8s_name(ARGV[8], true) or not utf8_text(ARGV[1]) or #ARGV[1] > 1024 then
    return redis.error_reply('ERR invalid pod identity: token prefix, pod, uid and node must be names of at ' ..
      'most 253 letters, digits and . - _ : (the worker name UTF-8)')
  end
  local retention = tonumber(ARGV[9]) or 0
  local before = redis.call('HGET', pods, prefix)
  local since = before and string.match(before, '^%d+ (%d+) ') or int_text(now)
  announced = int_text(now) .. ' ' .. since .. ' ' .. ARGV[7] .. ' ' .. ARGV[8] .. ' ' .. ARGV[6] .. ' ' .. ARGV[1]
  local sample = redis.call('HRANDFIELD', pods, SWEPT_PER_ANNOUNCEMENT, 'WITHVALUES')
  for i = 1, #sample, 2 do
    local seen = tonumber(string.match(sample[i + 1], '^(%d+) '))
    if sample[i] ~= prefix and (seen == nil or seen < now - retention) then gone[#gone + 1] = sample[i] end
  end
end
-- The entry is dropped first, a write that frees: a full Redis still lists the worker (FIRST_WRITE_FREES).
write('HDEL', K_WORKERS, ARGV[1])
if (tonumber(ARGV[2]) or -1) >= 0 then
  write('HSET', K_WORKERS, ARGV[1], ARGV[2] .. ' ' .. ARGV[3] .. ' ' .. int_text(now + (tonumber(ARGV[4]) or 0)))
end
for i = 1, #others, 2 do
  local expires = tonumber(string.match(others[i + 1], '(%S+)$'))
  if others[i] ~= ARGV[1] and (expires == nil or expires < now) then write('HDEL', K_WORKERS, others[i]) end
end
for _, gone_prefix in ipairs(gone) do write('HDEL', pods, gone_prefix) end
if announced then write('HSET', pods, prefix, announced) end
commit()
return {}
