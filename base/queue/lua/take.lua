-- take: move up to n live envelopes from the tier queues into this
-- dispatcher's inflight list, in one step, oldest first within a tier.
-- Each tier first gets its minimum share of the batch (if it has work), then
-- the rest is filled in strict priority order (KEYS order). Envelopes past
-- their deadline, cancelled, or unreadable (not JSON, or without a numeric
-- deadline_ms and string id, gateway and input) are dropped here and counted: they
-- never reach a worker. If work is left behind, the doorbell rings again so
-- another dispatcher holding a credit wakes for it.
-- Pacing: while less than a full batch is queued, batches are handed off no
-- closer together than min_interval_ms (the batch time divided by the number
-- of workers), fleet-wide. Workers then start evenly staggered instead of
-- all at once, so a request waits at most about one interval for a worker.
-- KEYS[1] inflight:{dispatcher}  KEYS[2] stats  KEYS[3] doorbell
-- KEYS[4] cancelled (zset: request id -> expiry epoch ms)  KEYS[5] last-dispatch
-- KEYS[6..] queue:{tier}, highest priority first
-- ARGV[1] n   ARGV[2] now (epoch ms)   ARGV[3] min_interval_ms
-- ARGV[4..] minimum slots per tier, KEYS order
-- Returns {envelopes, expired, cancelled, malformed, wait_ms}: wait_ms > 0
-- means nothing was taken: come back after that long.
local inflight, stats, doorbell, cancelled_set = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local n = tonumber(ARGV[1])
local now = tonumber(ARGV[2])
local min_interval = tonumber(ARGV[3])
local first_queue = 6
local ntiers = #KEYS - first_queue + 1
local taken, expired, cancelled, malformed = {}, 0, 0, 0

if min_interval > 0 then
  local last = tonumber(redis.call('GET', KEYS[5]) or '0')
  local wait = last + min_interval - now
  if wait > 0 then
    local queued = 0
    for i = 1, ntiers do queued = queued + redis.call('LLEN', KEYS[first_queue + i - 1]) end
    if queued > 0 and queued < n then return {taken, 0, 0, 0, wait} end
  end
end
local check_cancelled = redis.call('ZCARD', cancelled_set) > 0

local function pop_from(queue, limit)
  local got = 0
  while got < limit and #taken < n do
    local raw = redis.call('RPOP', queue)
    if not raw then return end
    local ok, env = pcall(cjson.decode, raw)
    if not ok or type(env) ~= 'table' or type(env.deadline_ms) ~= 'number'
        or type(env.id) ~= 'string' or type(env.gateway) ~= 'string'
        or type(env.input) ~= 'string' then
      malformed = malformed + 1
    elseif env.deadline_ms <= now then
      expired = expired + 1
    elseif check_cancelled and redis.call('ZSCORE', cancelled_set, env.id) then
      cancelled = cancelled + 1
      redis.call('ZREM', cancelled_set, env.id)
    else
      redis.call('RPUSH', inflight, raw)
      taken[#taken + 1] = raw
      got = got + 1
    end
  end
end

for i = 1, ntiers do
  local share = tonumber(ARGV[3 + i]) or 0
  if share > 0 then pop_from(KEYS[first_queue + i - 1], share) end
end
for i = 1, ntiers do
  pop_from(KEYS[first_queue + i - 1], n)
end

if expired > 0 then redis.call('HINCRBY', stats, 'expired_dropped', expired) end
if cancelled > 0 then redis.call('HINCRBY', stats, 'cancelled_dropped', cancelled) end
if malformed > 0 then redis.call('HINCRBY', stats, 'malformed_dropped', malformed) end
if check_cancelled then redis.call('ZREMRANGEBYSCORE', cancelled_set, '-inf', now) end

if #taken >= n then
  for i = 1, ntiers do
    if redis.call('LLEN', KEYS[first_queue + i - 1]) > 0 then
      redis.call('LPUSH', doorbell, '1')
      redis.call('LTRIM', doorbell, 0, 0)
      break
    end
  end
end
return {taken, expired, cancelled, malformed, 0}
