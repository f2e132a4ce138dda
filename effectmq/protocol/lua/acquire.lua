--[[ acquire: complete the caller's finished tasks (as complete.lua), then lease up to
`count` of the declared candidates that are ready, each under a new token, and name the
ids the next call may declare: a worker's steady state is one call per batch.
KEYS: the queue keys of keys.lua, then candidates: the task hashes of ids an earlier reply
  named (ready or due), or a wake message, or the caller's own offers; a call with none
  only names them. Before the candidates: the task hash of each completion's id, in order;
  after them: the receipt key of `receipt` and of each id in `resent` (use_receipts).
Last KEYS: starts, group_starts, group_due, group_ctl, backlog
  (all but starts only once the caller knows the queue counts its groups: group_caps.lua)
ARGV[1] count            how many tasks the caller can run now
ARGV[2] lock_timeout_ms  lease length (the queue's meta lock_timeout_ms wins when set)
ARGV[3] token_prefix     random per-process prefix; the token is prefix..":"..seq
ARGV[4] promote_batch    `due` names at most this many ids
ARGV[5] window           a candidate is leased only while it is among the first `window`
  waiting tasks and in the head's priority band (never before a task of higher priority)
ARGV[6] peek             how many waiting ids `ready` names
ARGV[7] retention_ms     for completed records (meta retention_completed_ms wins; -1 = keep)
ARGV[8] receipt          this call's receipt id ('' = none), unique per call
ARGV[9] resent           space-separated receipt ids of earlier calls that carried any of
  these completions
ARGV[10] rate_limit       "<tasks> <period_ms>" or '' (none): at most `tasks` leases start in
  any window of `period_ms` (the queue's meta rate_limit wins when set; rate.lua)
ARGV[11...] completions...: 3 values each: id, token, result
  result: JSON
Candidates that are due delayed tasks are promoted first, and may be leased at once.
Leases follow head order (priority, then FIFO): the first `count` candidates still
waiting, so a caller that declares more than it needs still gets its count when
other workers took some of them. A candidate whose group is paused or at its cap is
parked instead (group_caps.lua), and the next one is looked at; so is one whose group's rate
limit allows no start now, and the call hands back the parked tasks of groups now due.
Returns: {now, deadline, next_due, status, ready, due, outcomes, leases...}
  next_due: -1 = no delayed task and no group due; else the Redis time the next delayed task
  or rate-limited group is due; when rate_limited: the Redis time the next start is allowed
  status: "ok" | "paused" | "limited" (max_active reached) | "rate_limited" (the rate limit
  allows no start now, or starts are held: rate.lua)
  ready: at most `peek` waiting ids for this caller's next call: the candidates it did
  not need, then those after the ids the last caller was named (so competing workers
  declare different ids), else from the head; due: delayed ids due now. Both
  empty when status is not ok. outcomes: one per completion, as complete.lua's.
leases...: 11 values each: id, token, attempt, name, payload, handler_failure_count,
  stalled_attempt_count, max_retries, options, priority, trace
]]
--- @include "keys"
--- @include "time"
--- @include "writes"
--- @include "extras"
--- @include "meta"
--- @include "events"
--- @include "indexes"
--- @include "receipts"
--- @include "settle"
--- @include "leases"
--- @include "rate"
--- @include "names"
--- @include "group_caps"
local MAX_PROMOTE_BATCH = 1000  -- the client's bound too (protocol.MAX_PROMOTE_BATCH)
local GROUPS_DUE = 8  -- rate-limited groups a call hands parked tasks back to, at most
local group_keys = group_key_count()
if not group_keys then return group_keys_refused() end
local now = now_ms()
local retention = meta_num('retention_completed_ms', ARGV[7])
local last_keys
if group_keys > 0 then  -- and the group rate limits' two
  group_keys = group_keys + 2
  last_keys = declared_last({'starts', 'group_starts', 'group_due', 'group_ctl', 'backlog'})
else
  last_keys = declared_last({'starts'})
end
local K_STARTS = last_keys.starts
local caps = use_caps(last_keys)  -- nil: no group has a cap or a pause
local receipts = use_receipts(ARGV[8], ARGV[9], 1 + group_keys)
local outcomes, completed = complete_each(11, retention)
local count = tonumber(ARGV[1]) or 0
local window = tonumber(ARGV[5])
local lock_timeout = meta_num('lock_timeout_ms', ARGV[2])
local deadline = now + lock_timeout
local out = {now, deadline, 0, 'ok'}
out[5], out[6], out[7] = {}, {}, outcomes
local candidates, key_of = declared_ids((#ARGV - 10) / 3, receipts + 1 + group_keys)
-- Each waiting candidate's score (a due one promoted first: its new score). In slices:
-- unpack() of more than about 8,000 values fails, and the caller decides how many come.
local scores = {}
local promoted_scores = {}  -- id -> score of the candidates promoted here (not yet in Redis)
for from = 1, #candidates, 1000 do
  local part = redis.call('ZMSCORE', K_WAITING, unpack(candidates, from, math.min(from + 999, #candidates)))
  for j = 1, #part do scores[from + j - 1] = part[j] end
end
for i, id in ipairs(candidates) do
  local score = tonumber(scores[i])
  if not score then
    local promoted = promote_if_due(id, now)
    if type(promoted) == 'number' then
      score = promoted
      promoted_scores[id] = promoted
    end
  end
  scores[i] = score
end
if meta_num('paused', DEFAULTS.paused) == 1 then
  out[3] = next_due()
  out[4] = 'paused'
  return finish(out)
end
local max_active = meta_num('max_active', DEFAULTS.max_active)
if max_active > 0 then
  local room = max_active - (redis.call('ZCARD', K_ACTIVE) - completed)  -- their removal is still queued
  if room < count then count = room end
  if count <= 0 then
    out[3] = next_due()
    out[4] = 'limited'
    return finish(out)
  end
end
-- The rate limit: each lease started is logged in K_STARTS (rate.lua), after every read.
-- A hold (a downstream service's Retry-After) stops every start until it ends.
local rate_tasks, rate_period = rate_limit_of(meta_text('rate_limit') or ARGV[10])
local allowed_at = held_until()
if rate_tasks and not allowed_at then
  local started, next_start = rate_window(K_STARTS, rate_tasks, rate_period)
  if rate_tasks - started < count then count = rate_tasks - started end
  if next_start > now then allowed_at = next_start end
end
if allowed_at then
  out[3] = allowed_at
  out[4] = 'rate_limited'
  return finish(out)
end

-- The head of waiting (a candidate promoted here may be it), and the end of its priority
-- band (scores below it share the head's priority).
local head = redis.call('ZRANGE', K_WAITING, '0', '0', 'WITHSCORES')
local head_id, head_score = head[1], tonumber(head[2])
for id, score in pairs(promoted_scores) do
  if not head_score or score < head_score then head_id, head_score = id, score end
end
local band = head_score and (math.floor(head_score / PRIORITY_SPAN) + 1) * PRIORITY_SPAN

-- K_PEEKED holds the score of the last waiting id a reply named, after the token prefix
-- of the caller it was named to, or alone: see where it is written.
local last = redis.call('GET', K_PEEKED)
local last_text, last_score  -- the score as Redis wrote it, and as a number
if last then
  last_text = string.match(last, '^%S+ (%S+)$') or last
  last_score = tonumber(last_text)
end

-- The candidates still waiting near the head and in its band, in head order. They may
-- pass over tasks they do not include only when the head was named to some caller
-- (workers compete for the head); else the head must be one of them, so that a caller
-- that learnt of some tasks only (its own offers) leases in exact head order. The head
-- was named when it comes no later than the last id named and was waiting then: its
-- sequence number (the score within its band) is not after that id's. A head that came
-- later into a band before it (a retry, a release, a higher priority) was named to nobody.
local picks, pick_scores = {}, {}  -- ids and their scores, sorted by score below
local SORT_INLINE = 64  -- picks sorted inline at most: 2,016 comparisons in reverse order
if head_score and (key_of[head_id] or (last_score and head_score <= last_score
    and head_score % PRIORITY_SPAN <= last_score % PRIORITY_SPAN)) then
  local limit = band
  local edge_rank = int_text(window - 1)
  local edge = redis.call('ZRANGE', K_WAITING, edge_rank, edge_rank, 'WITHSCORES')
  if edge[2] and tonumber(edge[2]) < limit then limit = tonumber(edge[2]) + 1 end
  for i, id in ipairs(candidates) do
    local score = scores[i]
    if score and score < limit then
      picks[#picks + 1] = id
      pick_scores[#picks] = score
    end
  end
end
-- Candidates come in head order unless offers or wakes were named since: an insertion
-- sort costs one comparison per id then, table.sort a Lua call per comparison.
if #picks <= SORT_INLINE then
  for i = 2, #picks do
    local id, score, j = picks[i], pick_scores[i], i - 1
    while j >= 1 and pick_scores[j] > score do
      picks[j + 1], pick_scores[j + 1] = picks[j], pick_scores[j]
      j = j - 1
    end
    picks[j + 1], pick_scores[j + 1] = id, score
  end
else
  local score_of = {}
  for i, id in ipairs(picks) do score_of[id] = pick_scores[i] end
  table.sort(picks, function(a, b) return score_of[a] < score_of[b] end)
  for i, id in ipairs(picks) do pick_scores[i] = score_of[id] end  -- the scores in the same order
end
local taking = math.min(count, #picks)  -- the first picks
local rated  -- id -> group of the leases a group's rate limit counts (group_caps.lua)
local passed = taking  -- the first picks that leave waiting: those leased, then those parked
if caps and taking > 0 then
  -- The picks whose group may start one more, up to `count`; those of a group paused or at
  -- its cap are parked (group_caps.lua). Order: leased, parked, then those not looked at.
  local leasing, parked, rest = {}, {}, #picks + 1
  rated = {}  -- id -> its group, for the leases its group's rate limit logs
  for i = 1, #picks do
    if #leasing >= count then
      rest = i
      break
    end
    local group = redis.call('HGET', key_of[picks[i]], 'group')
    if group and group ~= '' and not may_start(caps, group) then
      park(caps, picks[i], key_of[picks[i]], group, pick_scores[i])
      parked[#parked + 1] = i
    else
      leasing[#leasing + 1] = i
      if group and group ~= '' and caps.groups[group].started then rated[picks[i]] = group end
    end
  end
  taking, passed = #leasing, #leasing + #parked
  local order = leasing  -- extended in place
  for _, i in ipairs(parked) do order[#order + 1] = i end
  for i = rest, #picks do order[#order + 1] = i end
  local ids, order_scores = {}, {}
  for n, i in ipairs(order) do ids[n], order_scores[n] = picks[i], pick_scores[i] end
  picks, pick_scores = ids, order_scores
end
local leased = {}  -- deadline, id pairs for the active index
local starts = {}  -- start time, sequence number pairs for the log of starts (rate limited only)
local deadline_text = int_text(deadline)  -- formatted once, as now_text()
local first_lease = #out + 1  -- where the leases start in the reply
if passed > 0 then zrem_all(K_WAITING, picks, 1, passed) end
if taking > 0 then
  local seq = take_seq(taking) - 1  -- one sequence number per lease token
  local n = #out
  local NO_OPTIONS = {false, false, false, false}
  local attempt_was, attempt, attempt_text  -- the last attempt field read and what follows it
  for i = 1, taking do
    local id = picks[i]
    local key = key_of[id]
    local f = redis.call('HMGET', key, 'extra', 'name', 'payload', 'handler_failure_count',
      'stalled_attempt_count', 'attempt')
    if f[2] then  -- every record has a name; none: the record is gone
      local options = NO_OPTIONS  -- max_retries, options, priority, trace, group
      if lists_extra(f[1], LEASE_EXTRAS) ~= false then  -- listed, or a record of an older version
        options = redis.call('HMGET', key, 'max_retries', 'options', 'priority', 'trace', 'group')
        group_left(options[5])
      end
      if f[6] ~= attempt_was then  -- most tasks of a call share it (a fresh task has '0')
        attempt_was = f[6]
        attempt = (tonumber(f[6]) or 0) + 1
        attempt_text = int_text(attempt)
      end
      local seq_text = int_text(seq + i)
      local token = ARGV[3] .. ':' .. seq_text
      leased[#leased + 1] = deadline_text
      leased[#leased + 1] = id
      if rate_tasks then
        starts[#starts + 1] = now_text()
        starts[#starts + 1] = seq_text
      end
      if rated and rated[id] then
        write('ZADD', caps.starts, '0', rated[id] .. '\0' .. string.format(GROUP_TIME_DIGITS, now) .. '\0' .. seq_text)
      end
      out[n + 1], out[n + 2], out[n + 3], out[n + 4], out[n + 5] = id, token, attempt, f[2], f[3]
      out[n + 6], out[n + 7] = f[4], f[5]
      out[n + 8], out[n + 9], out[n + 10], out[n + 11] = options[1], options[2], options[3], options[4]
      n = n + 11
      emit('active', id, 'attempt', attempt)
    end
  end
end

-- Name the next ids: the candidates left over, then after the ids the last caller was
-- named while they are near the head and in its band (else they were named but never
-- leased, or a task of higher priority came): from the head. Also when that caller was
-- this one: from the head it would be named the ids another caller holds, and take them.
local peek = tonumber(ARGV[6])
local named, listed = out[5], {}
for i = passed + 1, math.min(#picks, passed + peek) do
  named[#named + 1] = picks[i]
  listed[picks[i]] = true
end
-- The mark is before some of these (groups.lua moved it back before tasks that entered
-- waiting ahead of named ids): they are named in score order with the ids after the mark.
if last_score and #named > 0 and pick_scores[passed + #named] > last_score then
  out[5] = name_after_mark(named, pick_scores, passed, passed, picks, last_text, peek, ARGV[3])
elseif #named < peek then
  -- After the last named ids while all the ids named would still be within the window
  -- (the next call could not lease those past it), else from the head.
  -- Redis's waiting index still holds the ids leased here (their removal is queued): they
  -- are counted out, and read past.
  local from, after = '-inf', nil  -- after: the score the range starts after
  if last_score and band and last_score < band then
    local before = redis.call('ZCOUNT', K_WAITING, '-inf', last_text)
    for i = 1, passed do
      if pick_scores[i] <= last_score then before = before - 1 end
    end
    if before + peek - #named <= window then from, after = '(' .. last_text, last_score end
  end
  local skip, taken = 0, nil  -- ids leased (or parked) here that the range holds: it asks for as many more
  for i = 1, passed do
    if after == nil or pick_scores[i] > after then skip = skip + 1 end
  end
  if skip > 0 then  -- the ids leased here, to read past
    taken = {}
    for i = 1, passed do taken[picks[i]] = true end
  end
  local fresh = redis.call('ZRANGE', K_WAITING, from, '+inf', 'BYSCORE', 'LIMIT', '0', int_text(peek - #named + skip))
  if #fresh == 0 and from ~= '-inf' then
    fresh = redis.call('ZRANGE', K_WAITING, '-inf', '+inf', 'BYSCORE', 'LIMIT', '0', int_text(peek - #named + passed))
    taken = {}
    for i = 1, passed do taken[picks[i]] = true end
  end
  for i = 1, #fresh do
    if not listed[fresh[i]] and not (taken and taken[fresh[i]]) and #named < peek then named[#named + 1] = fresh[i] end
  end
  -- A hint: at maxmemory it may be this call's first write, and refused (FIRST_WRITE_FREES).
  -- The caller's prefix before the score is read by nothing since be069b9, but versions
  -- before the `or last` above find the score only after a word. Write the score alone
  -- once none of them shares a queue: from the first release on, or once
  -- tests/runtime/test_upgrade.py's OLD_VERSION reads it.
  if #fresh > 0 then
    hint('SET', K_PEEKED, ARGV[3] .. ' ' .. redis.call('ZSCORE', K_WAITING, fresh[#fresh]))
  end
end
out[3] = next_due()
if caps then  -- the rate-limited groups due now get their parked tasks back; the next due tells the caller
  local due = redis.call('ZRANGE', caps.due, '0', int_text(GROUPS_DUE), 'WITHSCORES')
  local next_group = nil
  for i = 1, #due, 2 do
    local at = tonumber(due[i + 1])
    if at > now or i > 2 * GROUPS_DUE then
      next_group = at
      break
    end
    local e = group_state(caps, due[i])
    local room = math.min(group_room(e), 1000)
    local handed = hand_back(caps, e.group, room)
    if handed == room and e.started and rate_room(e) <= room then
      e.due = rate_due(caps, e, handed)  -- its window is full again once these start
    elseif handed == 1000 then
      e.due = now
    elseif not e.due then
      write('ZREM', caps.due, e.group)
    end
  end
  for _, e in ipairs(caps.order) do
    if e.due and (next_group == nil or e.due < next_group) then next_group = e.due end
  end
  if next_group and (out[3] < 0 or next_group < out[3]) then out[3] = next_group end
end
if out[3] >= 0 and out[3] <= now then  -- some delayed tasks are due: name them (a bounded batch)
  local batch = int_text(math.max(1, math.min(tonumber(ARGV[4]) or 100, MAX_PROMOTE_BATCH)))
  local due = redis.call('ZRANGE', K_DELAYED, '-inf', now_text(), 'BYSCORE', 'LIMIT', '0', batch)
  for _, id in ipairs(due) do
    if not promoted_scores[id] then out[6][#out[6] + 1] = id end  -- not those promoted here
  end
end
write_gathered()
-- The leases, written last and straight from the reply (every read of the call is done, so
-- no write is queued for them: a copy per lease was most of what the queue cost here).
local attempt_was, attempt_text
for i = first_lease, #out, 11 do  -- a lease's values (as `n = n + 11` above)
  if out[i + 2] ~= attempt_was then attempt_was, attempt_text = out[i + 2], int_text(out[i + 2]) end
  redis.call('HSET', key_of[out[i]], 'state', 'active', 'token', out[i + 1], 'lock_until', deadline_text,
    'started_at', now_text(), 'attempt', attempt_text)
end
for i = 1, #leased, 1000 do redis.call('ZADD', K_ACTIVE, unpack(leased, i, math.min(i + 999, #leased))) end
if #starts > 0 then  -- the newest rate_tasks starts are all a window can count
  for i = 1, #starts, 1000 do redis.call('ZADD', K_STARTS, unpack(starts, i, math.min(i + 999, #starts))) end
  redis.call('ZREMRANGEBYRANK', K_STARTS, '0', int_text(-rate_tasks - 1))
  redis.call('PEXPIRE', K_STARTS, int_text(rate_span(rate_period)))
end
send_hints()
return out
