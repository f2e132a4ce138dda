-- meta.lua: queue-level settings from the meta hash.
--- @include "call"
--- @include "keys"

-- A number from the meta hash, or nil.
local function meta_value(field)
  if call.meta == nil then
    call.meta = {}
    local flat = redis.call('HGETALL', K_META)
    for i = 1, #flat, 2 do call.meta[flat[i]] = flat[i + 1] end
  end
  local v = call.meta[field]
  if v ~= nil and v ~= '' then return tonumber(v) end
  return nil
end

-- A text from the meta hash, or nil.
local function meta_text(field)
  meta_value(field)  -- the hash, read once per call
  local v = call.meta[field]
  if v ~= nil and v ~= '' then return v end
  return nil
end

-- Queue-level setting from the meta hash, or the caller's default.
local function meta_num(field, fallback)
  return meta_value(field) or tonumber(fallback)
end

-- A per-task option stored as a number, where -1 means "use the queue's value".
local function task_option(key, field, meta_field, fallback)
  local v = tonumber(redis.call('HGET', key, field) or '-1')
  if v == nil or v < 0 then return meta_num(meta_field, fallback) end
  return v
end
