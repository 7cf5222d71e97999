-- window: a key's limit over a sliding window of ten buckets. A hash (field:
-- the bucket's index, t * 10 // window; value: what was charged in it) holds
-- every bucket overlapping the last window (eleven: the oldest one in full),
-- with their sum ('s') as of the newest bucket ('l'): a charge reads four
-- fields and writes two. A request fits while the eleven buckets' sum plus
-- its cost stays within the limit plus a tenth (floor), and the last ten
-- buckets' within the limit: no span of one window is ever charged more than
-- 110 % of the limit, a burst gets the limit, and a client that keeps to its
-- rate is never refused. A hard bound (tokens) holds the eleven buckets
-- within the limit itself: no span of one window is charged more than it. A hash that is not one of counts starts over, empty.
-- Needs numbers.lua, budget.lua. Put before admit.lua (scripts.py).
local function window_expiry(window_ms)
  -- (a charge in bucket b leaves the window at (b + 11) tenths: 1.1
  -- windows from the start of b at most)
  return math.ceil(window_ms * 11 / 10) + 1000
end

local function empty_window(current, window_ms)
  -- a window with nothing charged (new, or started over)
  return {current = current, window_ms = window_ms, span = window_ms, eleven = 0, oldest = 0,
    held = 0, new = true, dirty = false}
end

local function write_window(key, w)
  -- what a call charged to a window, written once
  local bucket = tostring(w.current)
  if w.new then
    redis.call('HSET', key, bucket, w.held, 's', w.eleven, 'l', bucket)
    redis.call('PEXPIRE', key, window_expiry(w.window_ms))
  else
    redis.call('HSET', key, bucket, w.held, 's', w.eleven)
  end
end

local function moved_on(key, w, last)
  -- the window's sum without the buckets that left it since bucket `last`
  -- (deleted), its expiry set again; nil if one of them is not a count
  local sum = w.eleven
  local left = {}
  for index = last - 10, math.min(w.current - 11, last) do left[#left + 1] = tostring(index) end
  if #left > 0 then
    local amounts = redis.call('HMGET', key, unpack(left))
    for j = 1, #left do
      local amount = count(amounts[j] or 0)
      if amount == nil then return nil end
      sum = sum - amount
    end
    redis.call('HDEL', key, unpack(left))
  end
  redis.call('HSET', key, 's', sum, 'l', tostring(w.current))
  redis.call('PEXPIRE', key, window_expiry(w.window_ms))
  return sum
end

local function read_window(key, current, window_ms, floor)
  -- the window as of bucket `current`: the eleven buckets' sum, what the
  -- oldest of them holds (so the last ten's is the difference), whether it
  -- is new, and what bucket `current` holds. The buckets that left since the
  -- sum was last moved on are taken off it then and there (refused or not).
  -- A sum below -`floor` (the most it may hold) is planted: it starts over.
  local raw = redis.pcall('HMGET', key, 'l', 's', tostring(current - 10), tostring(current))
  if type(raw) ~= 'table' or raw.err then
    redis.call('DEL', key)
    return empty_window(current, window_ms)
  end
  if not raw[1] then
    -- new (or planted without its newest bucket: it starts over)
    if raw[2] or raw[3] or raw[4] then redis.call('DEL', key) end
    return empty_window(current, window_ms)
  end
  local last, sum = count(raw[1]), count(raw[2] or 0)
  local oldest, held = count(raw[3] or 0), count(raw[4] or 0)
  if last == nil or sum == nil or oldest == nil or held == nil or last > current then
    -- (one ahead of Redis's clock, which stepped back, would count until
    -- the clock reached it)
    redis.call('DEL', key)
    return empty_window(current, window_ms)
  end
  local w = {current = current, window_ms = window_ms, span = window_ms, eleven = sum,
    oldest = oldest, held = held, new = false, dirty = false}
  if last ~= current then w.eleven = moved_on(key, w, last) end
  if w.eleven == nil or w.eleven < -floor then
    redis.call('DEL', key)
    return empty_window(current, window_ms)
  end
  return w
end

local function window_room(key, w, cost, amount, allowed, now)
  -- Whether a charge of `cost` fits now, the eleven buckets within
  -- `allowed` and the last ten within `amount`; if not, the ms until it
  -- would (reading every bucket: only when refused; the current one as the
  -- call left it), -1 if never.
  local eleven, current = w.eleven, w.current
  if eleven + cost <= allowed and eleven - w.oldest + cost <= amount then return true, 0 end
  local fields = {}
  for j = 1, 11 do fields[j] = tostring(current - 11 + j) end
  local amounts = redis.call('HMGET', key, unpack(fields))
  amounts[11] = w.held
  for later = 1, 11 do
    local e, t = 0, 0
    for j = 1 + later, 11 do
      local a = count(amounts[j] or 0) or 0
      e = e + a
      if j >= 2 + later then t = t + a end
    end
    if e + cost <= allowed and t + cost <= amount then
      return false, math.ceil((current + later) * w.window_ms / 10) - now
    end
  end
  return false, -1
end

local function window_charge(w, cost)
  -- a charge that fit, held in the call's copy until written (a budget's
  -- reservation in flight until settled)
  w.eleven, w.held, w.dirty = w.eleven + cost, w.held + cost, true
  if w.budget and cost > 0 then w.in_flight = w.in_flight + cost end
end

local function write_any(key, w)
  if w.budget then write_budget(key, w) else write_window(key, w) end
end

local function windows_at(now)
  -- the windows one call charges at `now` (a window's length in ms, or a
  -- budget's period: budget.lua), each read once and written once (one of
  -- the same name and another length, which a policy edit could send, is
  -- written back and read again)
  local known = {}
  local windows = {now = now}
  function windows.get(key, span, floor)  -- (floor: read_window's)
    local w = known[key]
    if w and w.span == span then return w end
    if w and w.dirty then write_any(key, w) end
    if type(span) == 'string' then
      w = read_budget(key, span, now)
    else
      w = read_window(key, math.floor(now * 10 / span), span, floor)
    end
    known[key] = w
    return w
  end
  function windows.write_all()
    for key, w in pairs(known) do
      if w.dirty then write_any(key, w) end
    end
  end
  return windows
end
