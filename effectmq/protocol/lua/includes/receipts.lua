-- receipts.lua: receipts: where a call that deleted completed records remembers their tokens.
--- @include "call"
--- @include "keys"
--- @include "writes"
--- @include "indexes"
--- @include "time"

-- The receipts are declared last, or before the `after` queue keys declared last.
local function use_receipts(own, resent, after)
  local ids = {}
  if own ~= '' then ids[1] = own end
  if resent ~= '' then
    for id in string.gmatch(resent, '%S+') do ids[#ids + 1] = id end
  end
  local first = #KEYS - (after or 0) - #ids
  for i, id in ipairs(ids) do
    local key = BASE .. 'r:' .. id
    if KEYS[first + i] ~= key then error('undeclared receipt key ' .. key) end
    call.receipt_keys[i] = key
  end
  if own ~= '' then call.receipt = {key = call.receipt_keys[1], tokens = {}, until_ms = 0} end
  return #ids
end

-- Did a receipt this call was given complete `token` (and delete its record)? (What this
-- call settled itself outcome_of finds in call.settled first.)
local function in_receipts(token)
  if call.receipt_values == nil then
    call.receipt_values = {}
    for i, key in ipairs(call.receipt_keys) do call.receipt_values[i] = redis.call('GET', key) or '' end
  end
  local listed = ' ' .. token .. ' '
  for _, value in ipairs(call.receipt_values) do
    if string.find(value, listed, 1, true) then return true end
  end
  return false
end

-- A lone completion gets a settled marker instead: less memory and work than a key.
local function keep_receipt()
  if call.receipt == nil or #call.receipt.tokens == 0 then return end
  if #call.receipt.tokens == 1 then
    zadd_later(K_SETTLED, int_text(call.receipt.until_ms), '1:' .. call.receipt.tokens[1])  -- OUTCOME_COMPLETED
  else
    write('SET', call.receipt.key, ' ' .. table.concat(call.receipt.tokens, ' ') .. ' ', 'PX',
      int_text(math.max(1, call.receipt.until_ms - now_ms())))
  end
  call.receipt.tokens = {}
end
