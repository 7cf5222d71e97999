-- numbers: reading a number out of Redis, whose contents are not trusted.
-- Put before the scripts that read counts back (scripts.py).
local MOST_COUNT = 2 ^ 50  -- the most a settlement counts to (written as digits, read back)
local function count(raw)
  -- a count as a script writes it (Redis writes a Lua number that is a
  -- whole number below 2^53 in digits: a window that grew past that starts
  -- over), or nil if it is not one (planted: text, '0x10', ' 5', '1e3',
  -- 'nan', or past 18 digits)
  if type(raw) == 'string' and not (#raw <= 18 and string.find(raw, '^%-?%d+$')) then
    return nil
  end
  return tonumber(raw)
end

local function finite(raw)
  -- a number, or nil if it is none, or not finite (a planted 'nan' or 'inf')
  local value = tonumber(raw)
  if value == nil or value ~= value or value == math.huge or value == -math.huge then
    return nil
  end
  return value
end
