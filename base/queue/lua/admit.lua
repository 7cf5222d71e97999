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
-- Handed straight to an idle worker: a request admitted while nothing at all
-- is queued, an idle worker's credit is on `ready` (not held by a
-- dispatcher) and pacing would not hold it back, is formed into a batch of
-- its own here and handed off with that credit, as a dispatcher's take
-- would do the moment the doorbell woke it (take.lua: the same batch, rule
-- and counts), one hop and one round trip sooner. Anything queued ahead of
-- it (it could be of a higher tier, or jobs a batch would take along), no
-- published batching rule, or no live idle worker: it is queued as usual.
-- A long input is stored beside its envelope (queue/inputs.py), if admitted.
-- KEYS[1..n] the counters  KEYS[n+1] queue:{tier}  KEYS[n+2] doorbell
--   (without those two: charge only)
-- KEYS[n+3] the input's key, when one is stored beside (ARGV[3n+3] > 0)
-- KEYS[s..] (to hand it straight; s is n+3, or n+4 after an input's key)
--   ready, batch-rule, last-dispatch, stats, then every queue:{tier} and
--   jobs:{tier}
-- ARGV[1] n  ARGV[2] the envelope (when queued)
-- ARGV[3i], ARGV[3i+1], ARGV[3i+2] limit i's cost, amount and window (s)
-- ARGV[3n+3] the input's time to live in ms (0: none stored beside)
-- ARGV[3n+4] the input
-- ARGV[3n+5..3n+9] (to hand it straight) the batch id, who forms it (the
--   gateway), now (epoch ms), the worker heartbeat key prefix, the worker
--   hand-off list prefix (the batch goes to batches:{worker} of the worker
--   whose credit paid for it: that worker, and no other, runs it)
-- Returns {admitted (1 or 0), queue depth (0 if nothing was queued),
--          handed straight (1 or 0),
--          count_1, ttl_ms_1, ..., count_n, ttl_ms_n}: a counter after the
-- charge (before it, if refused), and the ms left in its window (-2: none open).
local n = tonumber(ARGV[1])
local input_ttl = tonumber(ARGV[3 * n + 3] or '0') or 0
local straight_from = input_ttl > 0 and n + 4 or n + 3
local sa = 3 * n + 5  -- the first argument to hand it straight
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

local function pacing_interval(rule_key, ntiers)
  -- the published rule's pacing interval (ms; 0 when batches are of one,
  -- as take.lua never holds a full batch); nil if there is no rule that
  -- take.lua would read (published_rule: rule.lua)
  local batch_size, interval = published_rule(rule_key, ntiers)
  if batch_size == nil then return nil end
  return batch_size > 1 and interval or 0
end

local function hand_straight()
  -- the envelope as a batch of its own, to an idle worker; false if it
  -- must be queued instead
  local d = straight_from
  local ready, rule_key, last_key, stats = KEYS[d], KEYS[d + 1], KEYS[d + 2], KEYS[d + 3]
  -- (no idle worker first: under load, the one check made)
  if redis.call('LLEN', ready) == 0 then return false end
  for i = d + 4, #KEYS do
    if redis.call('LLEN', KEYS[i]) > 0 then return false end
  end
  local interval = pacing_interval(rule_key, (#KEYS - d - 3) / 2)
  if interval == nil then return false end
  local now = tonumber(ARGV[sa + 2])
  local last = math.min(tonumber(redis.pcall('GET', last_key)) or 0, now)
  if interval > 0 and last + interval > now then return false end
  -- Nothing after the credit is spent may fail (the envelope would be
  -- queued as well): the keys it writes are checked first.
  local stats_kind = redis.call('TYPE', stats)['ok']
  if stats_kind ~= 'hash' and stats_kind ~= 'none' then return false end
  -- The oldest idle live worker's credit, as a dispatcher would take it
  -- (idle_worker.lua); the batch goes to that worker's hand-off list.
  local _, handoff = idle_worker(ready, ARGV[sa + 3], ARGV[sa + 4])
  if not handoff then return false end
  -- The batch as take.lua writes it (and wire.encode_batch).
  redis.call('LPUSH', handoff, '{"id":' .. cjson.encode(ARGV[sa]) .. ',"dispatcher":'
    .. cjson.encode(ARGV[sa + 1]) .. ',"formed_ms":' .. ARGV[sa + 2]
    .. ',"envelopes":[' .. ARGV[2] .. '],"attempt":0}')
  -- (a count that is not an integer stays wrong, as in take.lua; the batch goes)
  redis.pcall('HINCRBY', stats, 'batches_formed', 1)
  redis.pcall('HINCRBY', stats, 'requests_batched', 1)
  redis.call('SET', last_key, ARGV[sa + 2], 'PX', 60000)  -- (SET replaces any type)
  return true
end

local reply = {admitted, 0, 0}
if admitted == 1 then
  for i = 1, n do
    counts[i] = redis.call('INCRBY', KEYS[i], ARGV[3 * i])
    if ttls[i] < 0 then  -- this charge opened the window
      ttls[i] = tonumber(ARGV[3 * i + 2]) * 1000
      redis.call('PEXPIRE', KEYS[i], ttls[i])
    end
  end
  if input_ttl > 0 then redis.call('SET', KEYS[n + 3], ARGV[3 * n + 4], 'PX', input_ttl) end
  -- (a key of another type on the way: queued, as without a worker idle)
  local handable, handed = false, false
  if #KEYS >= straight_from then handable, handed = pcall(hand_straight) end
  if handable and handed then
    reply[3] = 1
  elseif #KEYS > n then
    reply[2] = redis.call('LPUSH', KEYS[n + 1], ARGV[2])
    redis.call('LPUSH', KEYS[n + 2], '1')
    redis.call('LTRIM', KEYS[n + 2], 0, 0)
  end
end
for i = 1, n do
  reply[2 * i + 2] = counts[i]
  reply[2 * i + 3] = ttls[i]
end
return reply
