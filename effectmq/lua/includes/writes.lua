-- writes.lua: rule 7: writes queued during the call and sent at its end; hints after them.
--- @include "call"
--- @include "keys"
--- @include "time"

-- VALIDATE BEFORE THE FIRST WRITE (runtime rule 7). Redis keeps what a script wrote before
-- it failed, so no script calls a write command itself: it queues it with write(), and
-- commit(), at its end (finish), sends the queued writes in order. Every read, decode,
-- encode and check of a call thus comes before its first write, and after that only
-- writes whose arguments are already computed run: nothing that can fail. Reads see the
-- state before the call; what the call itself changed it keeps in its own table (call.lua).
-- Notifications are hints (hint()): sent after the writes, through pcall, so a channel an
-- ACL denies never fails a call. tests/runtime/test_write_rule.py injects an error at
-- every step of every script up to its first write, and holds the rest to writes and hints.
-- FIRST_WRITE_FREES. Under maxmemory (noeviction) Redis refuses a command that may grow
-- memory only as a script's first write: later ones go through, or the script would stop
-- half done. The scripts that keep a running attempt alive or settle it (renew, complete,
-- fail, release, acquire's completions) first take the task out of the active index, a
-- write that frees, so a full Redis still lets the work in flight renew and finish, where
-- every attempt used to lose its lease and stall; offers and progress are refused. A
-- worker's announcement and a setting (pause) drop the old entry first, for the same
-- reason, and acquire's naming hint is written with pcall. As functions (Redis 7) the
-- same holds by flags: allow-oom on all but offer and progress, which a full Redis
-- refuses before they run (scripts.REFUSED_WHEN_FULL).

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
local function commit()
  for i = 1, #call.writes do redis.call(unpack(call.writes[i])) end
  if call.seq_used > 0 then
    redis.call('INCRBY', K_SEQ, int_text(call.seq_used))
    call.seq_base, call.seq_used = call.seq_base + call.seq_used, 0
  end
  for i = 1, #call.hints do redis.pcall(unpack(call.hints[i])) end
  call.writes, call.hints = {}, {}
end
