-- history.lua: errors as stored, and the history of attempts that ended without success.
--- @include "writes"
--- @include "time"

-- An error as stored: the caller's JSON when it is an object Lua can read and at most
-- MAX_ERROR_BYTES long, else a placeholder that says why. Checked before any write, so
-- no error value, however odd, can stop a settlement half done.
local MAX_ERROR_BYTES = 1048576
local function stored_error(error_json, kind)
  local why
  if #error_json > MAX_ERROR_BYTES then
    why = 'larger than ' .. MAX_ERROR_BYTES .. ' bytes (' .. #error_json .. ')'
  else
    local ok, value = pcall(cjson.decode, error_json)
    if not ok then
      why = 'not readable JSON (' .. string.sub(tostring(value), 1, 200) .. ')'
    elseif type(value) ~= 'table' or type(value.tag) ~= 'string' then
      why = 'not a JSON object with a tag'
    else
      return error_json
    end
  end
  return cjson.encode({tag = '~effectmq/Error/Defect', kind = kind,
    message = 'the error could not be stored: ' .. why})
end

-- Attempts that ended without success, kept on the task (newest last, at most
-- ATTEMPTS_KEPT) for its history: {attempt, outcome, at[, error][, cause]} (cause: a
-- stall's, as JSON: forensics.lua stall_cause).
local ATTEMPTS_KEPT = 20
local function record_attempt(key, outcome, error_json, now, cause_json)
  local f = redis.call('HMGET', key, 'attempt', 'attempts', 'attempt_sizes')
  local entry = '{"attempt":' .. int_text(tonumber(f[1]) or 0) .. ',"outcome":"' .. outcome .. '","at":' .. int_text(now)
  if error_json then entry = entry .. ',"error":' .. error_json end
  if cause_json then entry = entry .. ',"cause":' .. cause_json end
  entry = entry .. '}'
  local body, sizes = '', {}
  local text = f[2] or '[]'
  if text ~= '[]' and text ~= '' then
    local total = 1  -- the brackets, less the comma the first entry has none of
    for size in string.gmatch(f[3] or '', '%d+') do
      sizes[#sizes + 1] = tonumber(size)
      total = total + sizes[#sizes] + 1
    end
    if #sizes > 0 and total == #text then
      body = string.sub(text, 2, -2)
    else  -- a history written before attempt_sizes (or by an older version since): read it once
      sizes = {}
      local ok, list = pcall(cjson.decode, text)
      local parts = {}
      if ok and type(list) == 'table' then
        for _, item in ipairs(list) do
          local encoded, part = pcall(cjson.encode, item)
          if encoded then
            parts[#parts + 1] = part
            sizes[#sizes + 1] = #part
          end
        end
      end
      body = table.concat(parts, ',')
    end
  end
  local drop = 0  -- bytes of the oldest entries that go
  while #sizes >= ATTEMPTS_KEPT do
    drop = drop + table.remove(sizes, 1) + 1
  end
  if drop > 0 then body = string.sub(body, drop + 1) end
  if body == '' then body = entry else body = body .. ',' .. entry end
  sizes[#sizes + 1] = #entry
  write('HSET', key, 'attempts', '[' .. body .. ']', 'attempt_sizes', table.concat(sizes, ' '))
end
