-- names.lua: acquire's names when tasks entered waiting before the ids already named (groups.lua).
--- @include "call"
--- @include "keys"
--- @include "writes"
--- @include "time"

-- acquire.lua's names when the mark (K_PEEKED, text `mark`) is before some of the caller's
-- leftovers (named[i], scores[offset + i]): the `peek` first of them and of the waiting ids
-- after the mark, in score order; the ids leased in this call (the first `taking` picks)
-- are read past. The mark moves to the last of those ids named (after the caller's `prefix`).
local function name_after_mark(named, scores, offset, taking, picks, mark, peek, prefix)
  local fresh = redis.call('ZRANGE', K_WAITING, '(' .. mark, '+inf', 'BYSCORE', 'LIMIT', '0',
    int_text(peek + taking), 'WITHSCORES')
  local skip = {}
  for i = 1, taking do skip[picks[i]] = true end
  for _, id in ipairs(named) do skip[id] = true end
  local out, left, last = {}, 1, nil
  for i = 1, #fresh, 2 do
    if #out >= peek then break end
    if not skip[fresh[i]] then
      local score = tonumber(fresh[i + 1])
      while left <= #named and #out < peek and scores[offset + left] < score do
        out[#out + 1] = named[left]
        left = left + 1
      end
      if #out < peek then
        out[#out + 1] = fresh[i]
        last = fresh[i + 1]
      end
    end
  end
  while left <= #named and #out < peek do
    out[#out + 1] = named[left]
    left = left + 1
  end
  if last then hint('SET', K_PEEKED, prefix .. ' ' .. last) end
  return out
end
