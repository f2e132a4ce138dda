-- outcomes.lua: how a lease token settled its task, for a resent acknowledgement.
--- @include "call"
--- @include "keys"
--- @include "writes"
--- @include "receipts"

-- How an attempt settled (protocol.Outcome); 0 = not settled by that token (lease lost).
local OUTCOME_COMPLETED, OUTCOME_RETRY, OUTCOME_FAILED, OUTCOME_RELEASED = 1, 2, 3, 4
-- A worker resends an acknowledgement only while its lease may still be valid, so the
-- outcome of a deleted record is remembered until the lease's deadline, plus this slack.
local SETTLED_SLACK_MS = 5000

-- Remember that `token` settled this task with `outcome`.
local function record_outcome(key, token, outcome)
  write('HSET', key, 'token', '', 'last_token', token, 'last_outcome', outcome)
  call.settled[token] = outcome
end

-- How `token` settled this task (0 = it did not, or it is no longer known).
local function outcome_of(id, token)
  if token == '' then return 0 end
  if call.settled[token] then return call.settled[token] end  -- settled by this call
  local f = redis.call('HMGET', task_key(id), 'last_token', 'last_outcome')
  if f[1] == token then return tonumber(f[2]) or 0 end
  if in_receipts(token) then return OUTCOME_COMPLETED end
  for outcome = OUTCOME_COMPLETED, OUTCOME_RELEASED do
    if redis.call('ZSCORE', K_SETTLED, outcome .. ':' .. token) then return outcome end
  end
  return 0
end
