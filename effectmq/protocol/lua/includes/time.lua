-- time.lua: Redis time, read once per call, and integers as text.
--- @include "call"

-- Redis time in ms, read once per call (a script runs atomically: time stands still).
local function now_ms()
  if call.now == nil then
    local t = redis.call('TIME')
    call.now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return call.now
end

-- An integer as text. Redis turns a Lua number argument into text with printf's %.17g
-- (and Lua's `..` with %.14g): floating-point formatting, several times the cost of %d.
-- Clamped to +-2^53 (285,000 years of ms): '%d' of 2^63 or more prints a negative number,
-- and a huge retention or dedup window must mean 'for ever', never 'already over'.
local MAX_INT = 9007199254740992
local function int_text(n)
  if n > MAX_INT then n = MAX_INT elseif n < -MAX_INT then n = -MAX_INT end
  return string.format('%d', n)
end
-- now_ms() as text, formatted once.
local function now_text()
  if call.now_text == nil then call.now_text = int_text(now_ms()) end
  return call.now_text
end
