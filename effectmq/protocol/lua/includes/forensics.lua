--[[ forensics.lua: stall causes: which worker pod held a stalled lease, and how that pod ended.

The queue keys these scripts declare last (protocol.ScriptArgs.last_keys), after the task
hashes and receipts, so that no other script's key list grows:
  pods           hash of announced worker processes (workers.lua): token_prefix ->
                 "seen_ms since_ms uid node pod worker" (node may be empty; the worker name
                 is the rest of the line); since_ms: Redis time of the first announcement of
                 that process, seen_ms: of the last one. Kept while seen within retention.
  endings        hash of how worker pods ended (worker_ending.lua, from the operator): pod uid
                 -> "newest_at [ending...]", a JSON array of at most `kept` endings, oldest
                 first: {p: pod, n: node, c: cause, x: exit code (absent: unknown), m: message,
                 f: finished_at_ms given (-1: none), t: when it ended (f, else the Redis time
                 of its record), a: Redis time of its record}.
  stall_minutes  hash of stalls recovered per minute by cause, in MINUTE_SLOTS ring slots
                 (counts.lua): "m:<slot>" = the minute, "<cause>:<slot>" = its stalls then
  poison         zset of task ids that killed their worker's pod POISON_KILLS times or more,
                 score = Redis time of the last such stall; at most `poison_kept` ids
A stall's token is "<token_prefix>.<call>:<seq>", so its prefix names the process that held
the lease; pods names its pod uid and since when it ran; the ending blamed is the first
one of that uid that ended at or after since_ms, less FINISHED_AT_GRAIN (an earlier run of
the same pod, before a container restart, is never blamed).
]]
--- @include "call"
--- @include "keys"
--- @include "time"
--- @include "writes"

-- Stall causes (protocol.STALL_CAUSES, in order); an ending names any but 'unknown'.
local function stall_causes()
  return {'oom_killed', 'evicted', 'error_exit', 'deleted', 'node_lost', 'drained', 'unknown'}
end

-- Does `cause` say the pod died under the attempt (protocol.POD_DEATHS)?
local function pod_died(cause)
  return cause == 'oom_killed' or cause == 'error_exit' or cause == 'evicted' or cause == 'deleted' or
    cause == 'node_lost'
end

-- A pod, node or uid name as Kubernetes gives them: 1 to 253 letters, digits and . - _ :
-- ('' too when `may_be_empty`). No spaces: the pods hash separates its values by them.
local function k8s_name(text, may_be_empty)
  if text == '' then return may_be_empty end
  return #text <= 253 and string.find(text, '^[%w][%w%.%-_:]*$') ~= nil
end

-- Is `text` UTF-8? (JSON readers refuse anything else: a stored message must be.)
local function utf8_text(text)
  local i, n = 1, #text
  while i <= n do
    local c, len = string.byte(text, i), 0
    if c < 128 then len = 1 elseif c >= 194 and c < 224 then len = 2 elseif c >= 224 and c < 240 then len = 3
    elseif c >= 240 and c < 245 then len = 4 else return false end
    for j = i + 1, i + len - 1 do
      local b = string.byte(text, j)
      if b == nil or b < 128 or b >= 192 then return false end
    end
    i = i + len
  end
  return true
end

-- A decoded ending's field as text ('' when it is not a string).
local function ending_text(ending, field)
  local v = ending[field]
  if type(v) == 'string' then return v end
  return ''
end

-- The endings of pod `uid` as stored: their list (empty when none or unreadable).
local function endings_of(key, uid)
  local stored = redis.call('HGET', key, uid)
  local ok, list = pcall(cjson.decode, stored and string.match(stored, '^%d+ (.*)$') or '[]')
  if ok and type(list) == 'table' then return list end
  return {}
end

-- The kubelet reports a container's finishedAt in whole seconds: a run that ended within
-- the second it announced itself in shows an ending up to this much before its since_ms.
-- (A restarted container's new process takes longer than that to start and announce.)
local FINISHED_AT_GRAIN = 999

-- Why the attempt under `token` stalled: its cause as JSON (a history entry's `cause`), its
-- kind, pod and node ('' when unknown). Known when the token's process announced its pod
-- and an ending of that pod since; else 'unknown' with the last heartbeat's age: the lease
-- ran `lease_ms` from its last renewal, so that was at lock_until - lease_ms.
local function stall_cause(keys, token, lock_until, lease_ms, now)
  local prefix = string.match(token or '', '^([^.:]+)[.:]')
  local announced = prefix and redis.call('HGET', keys.pods, prefix)
  local pod, node = '', ''
  if announced then
    local since, uid, on, name = string.match(announced, '^%d+ (%d+) (%S+) (%S*) (%S+)')
    if name then
      pod, node = name, on
      local blamed, blamed_at = nil, nil
      for _, ending in ipairs(endings_of(keys.endings, uid)) do
        local at = type(ending) == 'table' and tonumber(ending.t)
        if at and at + FINISHED_AT_GRAIN >= tonumber(since) and (blamed_at == nil or at < blamed_at) then blamed, blamed_at = ending, at end
      end
      local kind = blamed and ending_text(blamed, 'c')
      if kind and kind ~= 'unknown' and string.find(' ' .. table.concat(stall_causes(), ' ') .. ' ', ' ' .. kind .. ' ', 1, true) then  -- a cause this version knows
        local cause = {kind = kind, pod = ending_text(blamed, 'p'), node = ending_text(blamed, 'n')}
        if cause.pod == '' then cause.pod = pod end
        if cause.node == '' then cause.node = node end
        if tonumber(blamed.x) then cause.exit_code = math.floor(tonumber(blamed.x)) end
        if ending_text(blamed, 'm') ~= '' then cause.message = ending_text(blamed, 'm') end
        local ok, json = pcall(cjson.encode, cause)
        if ok then return json, kind, cause.pod, cause.node end
      end
    end
  end
  local age = math.max(0, now - ((tonumber(lock_until) or now) - lease_ms))
  local json = '{"kind":"unknown","heartbeat_age_ms":' .. int_text(age)
  if pod ~= '' then json = json .. ',"pod":"' .. pod .. '","node":"' .. node .. '"' end  -- k8s_name: nothing to escape
  return json .. '}', 'unknown', pod, node
end

-- Stalls recovered in this call by cause, written once at its end (as counts.lua does).
local function count_stall(kind)
  if call.stall_counts == nil then call.stall_counts = {} end
  call.stall_counts[kind] = (call.stall_counts[kind] or 0) + 1
end
local function flush_stall_counts(key, slots)
  if call.stall_counts == nil then return end
  local minute = math.floor(now_ms() / 60000)
  local slot, minute_text = int_text(minute % slots), int_text(minute)
  if redis.call('HGET', key, 'm:' .. slot) == minute_text then
    for kind, n in pairs(call.stall_counts) do write('HINCRBY', key, kind .. ':' .. slot, int_text(n)) end
  else  -- the slot counted a minute long gone: its counts start again
    local stale, fresh = {'HDEL', key}, {'HSET', key, 'm:' .. slot, minute_text}
    for _, kind in ipairs(stall_causes()) do
      if call.stall_counts[kind] then
        fresh[#fresh + 1], fresh[#fresh + 2] = kind .. ':' .. slot, int_text(call.stall_counts[kind])
      else
        stale[#stale + 1] = kind .. ':' .. slot
      end
    end
    if #stale > 2 then write_command(stale) end
    write_command(fresh)
  end
  call.stall_counts = nil
end
