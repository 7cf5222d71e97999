-- give_back: what a reservation of a hard bound (tokens, a budget) did not
-- use, given back to the bucket it was charged in (window.lua, budget.lua),
-- so no window counts less than its requests used; a bucket gone (out of
-- every window) has nothing left to give back to. At most what the bucket
-- holds. Negative for a request that used more than it reserved: the
-- excess is charged to the same bucket, or a budget's to its current
-- period (budget.lua), counting to MOST_COUNT at most (numbers.lua). A
-- budget's reservation (`reserved`) is settled with it: no longer in flight.
-- Needs numbers.lua, budget.lua. Put before settle.lua and the takes (scripts.py).
local function give_back(key, bucket, back, reserved)
  if back < 0 and charge_budget_excess(key, bucket, -back, reserved) then return end
  settled_in_flight(key, bucket, reserved)
  local raw = redis.pcall('HMGET', key, bucket, 's')
  if back == 0 or type(raw) ~= 'table' or raw.err or not raw[1] or not raw[2] then return end
  local held, sum = count(raw[1]), count(raw[2])
  if held == nil or sum == nil then return end
  -- (a give-back never adds: a bucket or window left below it by refunds
  -- gives back only down to nothing)
  -- (an excess adds the same to the bucket and the sum, up to MOST_COUNT
  -- in the sum: 's' stays the buckets' sum, which window.lua moves on by)
  local x = back > 0 and math.max(math.min(back, held, sum), 0)
    or math.max(back, math.min(sum, MOST_COUNT) - MOST_COUNT)
  if x ~= 0 then redis.call('HSET', key, bucket, held - x, 's', sum - x) end
end

local function give_back_dropped(t, env)
  -- A request dropped before it ran (expired, cancelled) whose gateway
  -- left its reservation beside it (queue/gateway.py's withdraw: 'key
  -- bucket amount' each) gets all of it back, once. Only a quota's key,
  -- and only a give-back (Redis's contents are not trusted).
  local name = t.prefix .. 'give-back:' .. env.gateway .. ':' .. env.id
  local raw = redis.pcall('GET', name)
  if type(raw) ~= 'string' then return end
  redis.call('DEL', name)
  local quota = string.match(t.prefix, '^{[^}]*}:') .. 'quota:'
  for key, bucket, back in string.gmatch(raw, '(%S+) (%S+) (%S+)') do
    local amount = count(back)
    if amount and amount > 0 and string.sub(key, 1, #quota) == quota then
      give_back(key, bucket, amount, amount)
    end
  end
end

local function settle_job(record, tokens, gpu_us)
  -- A job's reservation (its record's 'reserved': 'key bucket amount unit'
  -- each, unit t for tokens, g for GPU µs; queue/gateway.py's enqueue_job),
  -- settled once, as its record leaves 'queued' or 'running' for good:
  -- what it did not use of `tokens` and `gpu_us` given back (all of it for
  -- a job dropped unrun, cancelled or failed), the excess charged.
  local raw = redis.call('HGET', record, 'reserved')
  if type(raw) ~= 'string' then return end
  redis.call('HDEL', record, 'reserved')
  local quota = (string.match(record, '^{[^}]*}:') or '\0') .. 'quota:'
  for key, bucket, amount, unit in string.gmatch(raw, '(%S+) (%S+) (%S+) ([tg])') do
    local reserved = count(amount)
    if reserved and reserved > 0 and string.sub(key, 1, #quota) == quota then
      give_back(key, bucket, reserved - (unit == 't' and tokens or gpu_us), reserved)
    end
  end
end
