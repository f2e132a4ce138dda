-- events.lua: the lifecycle event stream, written only while somebody reads it.
--- @include "call"
--- @include "keys"
--- @include "writes"
--- @include "time"
--- @include "meta"

local function emit(event, id, ...)
  if call.events_on == nil then
    call.events_on = meta_num('events_maxlen', DEFAULTS.events_maxlen) > 0 and
      (meta_num('events_always', DEFAULTS.events_always) == 1 or (meta_value('events_until') or 0) > now_ms())
  end
  if call.events_on then
    write('XADD', K_EVENTS, 'MAXLEN', '~', meta_num('events_maxlen', DEFAULTS.events_maxlen),
      '*', 'event', event, 'id', id, 'at', now_ms(), ...)
  end
end
