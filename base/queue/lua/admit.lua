-- admit: charge a request to its key's limits and, if every limit has room,
-- queue its envelope and ring the doorbell: one step, one round trip.
-- Each limit is a fixed window as the `limits` library keeps it (its key
-- names, a counter that expires `expiry` seconds after the charge that
-- opened its window). A request over any limit is charged to none: the
-- counters only ever hold what was admitted, across every gateway, and a
-- refusal has nothing to refund. A counter that is not a canonical integer
-- (Redis contents are not trusted: text, '007', a list) starts again from
-- zero, and one without an expiry gets its window's, refused or not, so no
-- key can be blocked for ever.
-- A refund is a charge of minus the cost.
-- KEYS[1..n] the counters  KEYS[n+1] queue:{tier}  KEYS[n+2] doorbell
--   (without those two: charge only)
-- ARGV[1] n  ARGV[2] the envelope (when queued)
-- ARGV[3i], ARGV[3i+1], ARGV[3i+2] limit i's cost, amount and window (s)
-- Returns {admitted (1 or 0), queue depth (0 if nothing was queued),
--          count_1, ttl_ms_1, ..., count_n, ttl_ms_n}: a counter after the
-- charge (before it, if refused), and the ms left in its window (-2: none open).
local n = tonumber(ARGV[1])
local counts, ttls = {}, {}
local admitted = 1
for i = 1, n do
  local key, window_ms = KEYS[i], tonumber(ARGV[3 * i + 2]) * 1000
  local raw = redis.pcall('GET', key)  -- an error: a key of another type
  -- Only a counter INCRBY can count on: '0', or an integer without leading
  -- zeros, in 18 digits. Anything else (another type, text, '007') starts over.
  if raw and not (type(raw) == 'string'
      and (raw == '0' or (#raw <= 18 and string.match(raw, '^%-?[1-9]%d*$')))) then
    redis.call('DEL', key)
    raw = false
  end
  ttls[i] = -2
  if raw then
    ttls[i] = redis.call('PTTL', key)
    if ttls[i] == -1 then  -- a window that never ends, ended
      redis.call('PEXPIRE', key, window_ms)
      ttls[i] = window_ms
    end
  end
  counts[i] = tonumber(raw or '0')
  if counts[i] + tonumber(ARGV[3 * i]) > tonumber(ARGV[3 * i + 1]) then admitted = 0 end
end
local reply = {admitted, 0}
if admitted == 1 then
  for i = 1, n do
    counts[i] = redis.call('INCRBY', KEYS[i], ARGV[3 * i])
    if ttls[i] < 0 then  -- this charge opened the window
      ttls[i] = tonumber(ARGV[3 * i + 2]) * 1000
      redis.call('PEXPIRE', KEYS[i], ttls[i])
    end
  end
  if #KEYS > n then
    reply[2] = redis.call('LPUSH', KEYS[n + 1], ARGV[2])
    redis.call('LPUSH', KEYS[n + 2], '1')
    redis.call('LTRIM', KEYS[n + 2], 0, 0)
  end
end
for i = 1, n do
  reply[2 * i + 1] = counts[i]
  reply[2 * i + 2] = ttls[i]
end
return reply
