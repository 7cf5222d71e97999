-- budget: a key's budget over a calendar period on Redis's clock (UTC: a
-- day, a week from Monday, or a month), kept as window.lua keeps a window
-- (the period's index its one bucket, 's' their sum, 'l' the index), so
-- settle.lua gives back to it as to a window; 'f' is what of it is reserved
-- by requests not settled yet (in flight), so a refusal can say whether
-- waiting for them may make room. A hard bound: nothing is
-- admitted past it, and a new period starts from nothing.
-- Needs numbers.lua. Put before window.lua (scripts.py).
local DAY_MS = 86400000

local function days_from_civil(y, m, d)
  -- days since 1970-01-01 of a date (the proleptic Gregorian calendar)
  if m <= 2 then y = y - 1 end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local mp = m > 2 and m - 3 or m + 9
  local doy = math.floor((153 * mp + 2) / 5) + d - 1
  local doe = yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy
  return era * 146097 + doe - 719468
end

local function month_of(day)
  -- the year and month (1-12) of a day since 1970-01-01
  local z = day + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524)
    - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local m = mp < 10 and mp + 3 or mp - 9
  return yoe + era * 400 + (m <= 2 and 1 or 0), m
end

local function period_at(now, period)
  -- the index of the period `now` (epoch ms) falls in, and when it ends
  -- (base/periods.py counts them the same way)
  local day = math.floor(now / DAY_MS)
  if period == 'day' then return day, (day + 1) * DAY_MS end
  if period == 'week' then
    local week = math.floor((day + 3) / 7)  -- (1970-01-01 was a Thursday)
    return week, (week * 7 + 4) * DAY_MS
  end
  local y, m = month_of(day)
  local next_y, next_m = y, m + 1
  if m == 12 then next_y, next_m = y + 1, 1 end
  return y * 12 + m - 1, days_from_civil(next_y, next_m, 1) * DAY_MS
end

local function read_budget(key, period, now)
  -- the budget's count in the current period (a call's copy, as
  -- window.lua's read_window returns a window's): a hash of another
  -- period, or not one of counts (a sum below nothing: give-backs stop
  -- there), starts over
  local current, ends = period_at(now, period)
  local w = {current = current, span = period, ends = ends, budget = true, eleven = 0,
    oldest = 0, held = 0, in_flight = 0, new = true, dirty = false}
  local raw = redis.pcall('HMGET', key, 'l', 's', 'f')
  if type(raw) ~= 'table' or raw.err then
    redis.call('DEL', key)
    return w
  end
  local last, sum = count(raw[1] or ''), count(raw[2] or '')
  if last == current and sum ~= nil and sum >= 0 then
    w.eleven, w.held, w.new = sum, sum, false
    w.in_flight = math.max(count(raw[3] or 0) or 0, 0)
  elseif raw[1] or raw[2] or raw[3] then
    redis.call('DEL', key)
  end
  return w
end

local function write_budget(key, w)
  -- what a call charged to a budget, written once; kept a minute past its
  -- period (a late give-back finds it; the next period's first charge
  -- starts over)
  local bucket = tostring(w.current)
  redis.call('HSET', key, bucket, w.held, 's', w.eleven, 'l', bucket, 'f', w.in_flight)
  if w.new then redis.call('PEXPIREAT', key, w.ends + 60000) end
end

local function budget_period(key)
  -- the period of a budget's key (quota.py names them
  -- quota:budget/{key id}/{unit}/{period}), nil for any other key
  local period = string.match(key, '^%b{}:quota:budget/.+/(%a+)$')
  if period == 'day' or period == 'week' or period == 'month' then return period end
  return nil
end

local function settled_in_flight(key, bucket, reserved)
  -- A reservation of `reserved` charged to a budget in period `bucket`
  -- settled: no longer in flight (nothing for a window's key, or a period
  -- since ended).
  if reserved <= 0 or not budget_period(key) then return end
  local raw = redis.pcall('HMGET', key, 'l', 'f')
  if type(raw) ~= 'table' or raw.err or raw[1] ~= bucket then return end
  local in_flight = count(raw[2] or '')
  if in_flight and in_flight > 0 then
    redis.call('HSET', key, 'f', math.max(in_flight - reserved, 0))
  end
end

local function charge_budget_excess(key, bucket, x, reserved)
  -- What a request used over its reservation of a budget (x > 0), charged
  -- to the budget's current period, whichever its reservation (`reserved`,
  -- in period `bucket`) was charged in (one ended since counts nothing),
  -- its reservation settled. False for a key not a budget's.
  local period = budget_period(key)
  if not period then return false end
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local w = read_budget(key, period, now)
  x = math.min(x, math.max(MOST_COUNT - w.eleven, 0))
  w.eleven, w.held = w.eleven + x, w.held + x
  if bucket == tostring(w.current) then w.in_flight = math.max(w.in_flight - reserved, 0) end
  write_budget(key, w)
  return true
end

local function budget_room(w, cost, amount, least, now)
  -- whether a charge of `cost` fits, and what is charged: all of it, or
  -- for an estimate (least > 0: a GPU budget's reservation) what is left,
  -- where that is at least `least` or the whole budget (the period's last
  -- request); if it does not fit, the ms until the period ends (-1: never,
  -- more than the whole budget; 0: not now, but it would if reservations
  -- in flight gave back what they hold, as they may when they settle)
  local left = amount - w.eleven
  if cost <= left then return true, 0, cost end
  if least > 0 and left >= math.min(least, amount) then return true, 0, left end
  if cost > amount and least == 0 then return false, -1, cost end
  local free = left + w.in_flight
  if cost <= free or (least > 0 and free >= math.min(least, amount)) then
    return false, 0, cost
  end
  return false, w.ends - now, cost
end
