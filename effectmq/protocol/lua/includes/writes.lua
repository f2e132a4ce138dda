-- writes.lua: rule 7: writes queued during the call and sent at its end; hints after them.
--- @include "call"
--- @include "keys"
--- @include "time"

-- VALIDATE BEFORE THE FIRST WRITE (runtime rule 7). Redis keeps what a script wrote before
-- it failed, so a script queues its writes with write(), and commit(), at its end
-- (finish), sends them in order (acquire then writes its leases itself, every read done).
-- Every read, decode, encode and check of a call thus comes before its first write, and
-- after that only writes whose arguments are already computed run: nothing that can fail.
-- Reads see the state before the call; what the call itself changed it keeps in its own
-- table (call.lua).
-- Notifications are hints (hint()): sent after the writes, through pcall, so a channel an
-- ACL denies never fails a call. tests/runtime/test_write_rule.py injects an error at
-- every step of every script up to its first write, and holds the rest to writes and hints.

-- FIRST_WRITE_FREES. Redis under maxmemory (noeviction) refuses a script only at its
-- first write that may grow memory: the scripts that keep work in flight alive (renew,
-- complete, fail, release, acquire's completions), a worker's announcement and a setting
-- write first what frees, so a full Redis still lets them through; offers and progress are
-- refused (scripts.REFUSED_WHEN_FULL; docs/protocol.md).
local function write(...)
  call.writes[#call.writes + 1] = {...}
end
-- A write whose command table the caller built ({command, key, args...}): not copied again.
local function write_command(command)
  call.writes[#call.writes + 1] = command
end
local function hint(...)
  call.hints[#call.hints + 1] = {...}
end

-- Sequence numbers (FIFO order within a priority band, lease tokens): the counter is read
-- once, numbers are handed out here, and commit() adds how many were taken.
local function take_seq(n)
  if call.seq_base == nil then
    call.seq_base = tonumber(redis.call('GET', K_SEQ) or '0')
    if call.seq_base == nil or call.seq_base ~= math.floor(call.seq_base) then error('corrupt sequence counter ' .. K_SEQ) end
  end
  call.seq_used = call.seq_used + n
  return call.seq_base + call.seq_used - n + 1
end

-- Send the queued writes in order, then the hints (whose failure changes nothing).
-- commit_writes() and send_hints() are its two halves, for a script that writes more of
-- its own between them (acquire's leases).
local function commit_writes()
  if call.caps then call.caps.flush() end  -- its reads first (group_caps.lua), then the groups' it changed
  if call.groups then call.groups.flush() end  -- its reads first (groups.lua)
  for i = 1, #call.writes do redis.call(unpack(call.writes[i])) end
  if call.seq_used > 0 then
    redis.call('INCRBY', K_SEQ, int_text(call.seq_used))
    call.seq_base, call.seq_used = call.seq_base + call.seq_used, 0
  end
  call.writes = {}
end
local function send_hints()
  for i = 1, #call.hints do redis.pcall(unpack(call.hints[i])) end
  call.hints = {}
end
local function commit()
  commit_writes()
  send_hints()
end
