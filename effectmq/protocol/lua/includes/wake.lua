-- wake.lua: wake-ups for idle workers (hints).
--- @include "keys"
--- @include "writes"
--- @include "meta"

-- Idle workers may acquire again. `ids` (optional) names tasks now waiting: the message
-- carries the first WAKE_IDS of them (a JSON array), which a woken worker declares at
-- once instead of asking which ids are ready first.
local WAKE_IDS = 16
local function wake(ids)
  local message = '1'
  if ids and #ids > 0 then
    message = cjson.encode({unpack(ids, 1, math.min(#ids, WAKE_IDS))})
  end
  hint('PUBLISH', BASE .. 'wake', message)
end

-- A slot under max_active was freed: waiting workers may acquire again.
local function freed_slot()
  if meta_num('max_active', DEFAULTS.max_active) > 0 then wake() end
end
