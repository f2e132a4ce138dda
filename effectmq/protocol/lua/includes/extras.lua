-- extras.lua: the optional fields of a task hash, listed in its `extra` field.

-- The optional fields of a task hash, left out at their defaults, and their letters in
-- its `extra` field, which lists those it has ('' = none): readers look only for those.
local EXTRA_LETTER = {explicit_id = 'e', priority = 'p', max_retries = 'r', max_stalled_count = 's', options = 'o', trace = 't', group = 'g'}
-- a pattern of the letters of those a lease reads: max_retries, options, priority, trace
-- (which it carries), group (which it counts)
local LEASE_EXTRAS = '[roptg]'

-- Does a record's extra field, as read, list a letter of `letters` (a pattern)? nil when
-- it has none: a record written before there was one, which only its fields can tell.
local function lists_extra(extra, letters)
  if extra == '' then return false end
  if extra then return string.find(extra, letters) ~= nil end
  return nil
end

-- Does the record under `key` have optional field `field`? `extra`: its extra field as read.
local function has_extra(key, extra, field)
  local listed = lists_extra(extra, EXTRA_LETTER[field])
  if listed == nil then return redis.call('HEXISTS', key, field) == 1 end
  return listed
end
