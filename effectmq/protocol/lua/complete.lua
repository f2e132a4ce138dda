--[[ complete: settle owned tasks as completed with their results (one or many per call).
KEYS: the queue keys of keys.lua, then the task hash of each record's id, in order, then
  the receipt key of `receipt` and of each id in `resent` (receipts.lua's use_receipts).
ARGV[1] retention_ms  for completed records (meta retention_completed_ms wins; -1 = keep)
ARGV[2] receipt       this call's receipt id ('' = none), unique per call
ARGV[3] resent        space-separated receipt ids of earlier calls that carried any of these
ARGV[4...] completions...: 3 values each: id, token, result
  result: JSON
Last KEYS: group_ctl, backlog
  (only once the caller knows the queue counts its groups: group_caps.lua group_key_count)
Returns: {outcomes...}  one per completion (protocol.Outcome): 1 = completed (now, or by
  this token before: a resent acknowledgement), 2/3/4 = this token settled otherwise
  before (retry, failed, released), 0 = lease lost (nothing changed).
]]
--- @include "meta"
--- @include "receipts"
--- @include "settle"
--- @include "leases"
--- @include "group_caps"
local group_keys = group_key_count()
if not group_keys then return group_keys_refused() end
local retention = meta_num('retention_completed_ms', ARGV[1])
use_receipts(ARGV[2], ARGV[3], group_keys)
if caps_from() then use_caps(declared_last({'group_ctl', 'backlog'})) end  -- ended attempts free their group's slots
local outcomes = complete_each(4, retention)
return finish(outcomes)
