--[[ worker_ending: remember how a worker pod (or one run of its container) ended, for the
stalls of the attempts it held (maintain.lua names the cause; forensics.lua the layout).
KEYS: the queue keys of keys.lua.
ARGV[1] uid             the pod's uid: its endings are kept under it
ARGV[2] pod             the pod's name
ARGV[3] node            its node ('' = unknown)
ARGV[4] cause           a stall cause but 'unknown' (protocol.STALL_CAUSES)
ARGV[5] exit_code       an integer, '' = unknown
ARGV[6] message         UTF-8, at most 1024 bytes (256 characters)
ARGV[7] finished_at_ms  when the container ended (ms since the epoch, below 10^14: cjson
  writes 14 digits exactly); -1 = unknown: the Redis time of this record stands for it
ARGV[8] retention_ms    endings recorded longer ago than this are dropped
ARGV[9] kept            at most this many endings per uid (the newest)
Last KEYS: endings
Every argument is checked before anything is written; a bad one is an error reply that
names it. The same ending again (uid, finished_at_ms and cause) writes nothing. Each call
also looks at two other uids, at random, and drops those whose newest ending is past the
retention: O(1) per call, bounded by the pods the operator saw end within it.
Returns: recorded  1, or 0 when the same ending was known
]]
--- @include "keys"
--- @include "time"
--- @include "writes"
--- @include "forensics"
local SWEPT_PER_CALL = 2
local now = now_ms()
local endings = declared_last({'endings'}).endings
local uid, pod, node, cause, exit_code, message = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local finished_at, retention, kept = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
local function refuse(what) return redis.error_reply('ERR invalid worker ending: ' .. what) end  -- nothing written
if not k8s_name(uid, false) then return refuse('uid must be 1 to 253 letters, digits and . - _ :') end
if not k8s_name(pod, false) then return refuse('pod must be 1 to 253 letters, digits and . - _ :') end
if not k8s_name(node, true) then return refuse('node must be empty or 1 to 253 letters, digits and . - _ :') end
if cause == 'unknown' or not string.find(cause, '^[a-z_]+$') or
    not string.find(' ' .. table.concat(stall_causes(), ' ') .. ' ', ' ' .. cause .. ' ', 1, true) then
  return refuse('unknown cause (known: ' .. table.concat(stall_causes(), ', ', 1, #stall_causes() - 1) .. ')')
end
local code = tonumber(exit_code)
if exit_code ~= '' and (not string.find(exit_code, '^%-?%d+$') or #exit_code > 11 or code > 2147483647 or code < -2147483648) then
  return refuse('exit_code must be an integer of 32 bits')
end
if #message > 1024 or not utf8_text(message) then return refuse('message must be UTF-8 of at most 1024 bytes') end
if finished_at == nil or finished_at ~= math.floor(finished_at) or finished_at < -1 or finished_at > 99999999999999 then
  return refuse('finished_at_ms must be -1 or an integer of ms since the epoch')
end
if retention == nil or retention < 0 or kept == nil or kept < 1 or kept > 100 then
  return refuse('retention_ms must be >= 0 and kept between 1 and 100')
end

local list = endings_of(endings, uid)
for _, ending in ipairs(list) do
  if type(ending) == 'table' and tonumber(ending.f) == finished_at and ending.c == cause then return 0 end
end
local fresh = {}
for _, ending in ipairs(list) do
  if type(ending) == 'table' and tonumber(ending.a) and tonumber(ending.a) >= now - retention then fresh[#fresh + 1] = ending end
end
local entry = {p = pod, n = node, c = cause, m = message, f = finished_at, a = now, t = finished_at >= 0 and finished_at or now}
if exit_code ~= '' then entry.x = code end
fresh[#fresh + 1] = entry
table.sort(fresh, function(a, b) return (tonumber(a.t) or 0) < (tonumber(b.t) or 0) end)
while #fresh > kept do table.remove(fresh, 1) end
local newest = 0
for _, ending in ipairs(fresh) do newest = math.max(newest, tonumber(ending.a) or 0) end
local stored = int_text(newest) .. ' ' .. cjson.encode(fresh)
local gone = {}
local sample = redis.call('HRANDFIELD', endings, SWEPT_PER_CALL, 'WITHVALUES')
for i = 1, #sample, 2 do
  local at = tonumber(string.match(sample[i + 1], '^(%d+) '))
  if sample[i] ~= uid and (at == nil or at < now - retention) then gone[#gone + 1] = sample[i] end
end
for _, other in ipairs(gone) do write('HDEL', endings, other) end
write('HSET', endings, uid, stored)
commit()
return 1
