--[[ due: the schedules whose next fire time has come, by Redis time.
KEYS: the scheduler keys of lib.lua, then the candidates' hashes: the caller reads the
      earliest entries of the due zset first (a plain read), so every hash a call may
      touch is declared; which candidates are due is decided here, by Redis time.
ARGV[1] upto ('' for none): only schedules due at or before this time (ms), when it is
        before now: a pass taken in slices reads what was due when it began, and ends
ARGV[2] bound ('' for none): the candidates are the earliest entries scored at or before it
ARGV[3..] the candidates' ids, earliest first (at most a batch)
Returns: {now, next, id1, spec1, version1, cursor1, decided1, suspension1, id2, ...}
  now  = Redis time (ms)
  next = the earliest fire time after min(now, upto, bound) (ms), -1 if none: when the
         caller's bound fell short of Redis time, the schedules due after it come next
  decided = the Redis time (ms) to decide this schedule with (lib.lua's decided_at: now,
         unless a decision from this version and cursor was read before)
  suspension = lib.lua's suspension(): "<suspended_at>:<resumed_at>" or ''
A candidate no longer in the due zset, or due later, is passed over. Costs O(candidates
* log n). A hash written without version or cursor (by hand) gets version 1 and a
cursor of now.
]]
local now = now_ms()
local upto = math.min(now, tonumber(ARGV[1]) or now)
local after = math.min(upto, tonumber(ARGV[2]) or upto)
local upcoming = redis.call('ZRANGEBYSCORE', K_DUE, '(' .. after, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
local out = {now, upcoming[2] or -1}
for i = 3, #ARGV do
  local id = ARGV[i]
  local key = schedule_key(id)
  local score = tonumber(redis.call('ZSCORE', K_DUE, id))
  if score and score <= upto then
    local row = redis.call('HMGET', key, 'spec', 'version', 'cursor', 'decided_at', 'suspended_at', 'resumed_at')
    if row[1] and not (row[2] and row[3]) then  -- what HSETNX will leave there
      if not row[2] then write('HSET', key, 'version', 1); row[2] = '1' end
      if not row[3] then write('HSET', key, 'cursor', now); row[3] = string.format('%d', now) end
      changed(id)
    end
    if row[1] then
      out[#out + 1] = id
      out[#out + 1] = row[1]
      out[#out + 1] = row[2]
      out[#out + 1] = row[3]
      out[#out + 1] = decided_at(key, row[2], row[3], row[4], now)
      out[#out + 1] = suspension(row[5], row[6])
    else
      forget(id) -- its hash is gone: nothing to schedule
    end
  end
end
commit()
return out
