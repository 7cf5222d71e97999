-- take: move up to n live envelopes from the tier queues into this
-- dispatcher's inflight list, in one step, oldest first within a tier.
-- Each tier first gets its minimum share of the batch (if it has work), then
-- the rest is filled in strict priority order (KEYS order). Envelopes past
-- their deadline, cancelled, or unreadable (not JSON, or without a numeric
-- deadline_ms and string id, gateway and input) are dropped here and counted: they
-- never reach a worker. If work is left behind, the doorbell rings again so
-- another dispatcher holding a credit wakes for it.
-- Jobs (asynchronous) come after every synchronous request, by tier among
-- themselves: they fill the slots synchronous work leaves in a batch, and
-- make a batch of their own only while at least `headroom` other workers
-- are idle (their credits on the ready list), so a synchronous request that
-- arrives finds a worker free, or once no synchronous batch has been handed
-- off for quiet_ms (a fleet smaller than its headroom still drains its jobs
-- when synchronous traffic stops). A job taken is marked 'running'; one dropped
-- is marked 'expired'; either way its key's queued count goes down (a
-- cancelled one already went down when it was cancelled, cancel_job.lua).
-- Pacing: while less than a full batch of synchronous work is queued, batches
-- are handed off no closer together than min_interval_ms (the batch time
-- divided by the number of workers), fleet-wide. Workers then start evenly
-- staggered instead of all at once, so a request waits at most about one
-- interval for a worker.
-- KEYS[1] inflight:{dispatcher}  KEYS[2] stats  KEYS[3] doorbell
-- KEYS[4] cancelled (zset: request id -> expiry epoch ms)  KEYS[5] last-dispatch
-- KEYS[6] ready  KEYS[7] jobs-queued (hash: key id -> jobs queued)
-- KEYS[8] the heartbeat of the worker whose credit this dispatcher holds
-- KEYS[9..8+T] queue:{tier}, highest priority first; KEYS[9+T..8+2T] jobs:{tier}
-- If that worker's heartbeat is gone (it stopped or died while its credit
-- was held), nothing is taken: a batch for it would wait for another worker.
-- ARGV[1] n   ARGV[2] now (epoch ms)   ARGV[3] min_interval_ms
-- ARGV[4] headroom (idle workers a jobs-only batch must leave; -1: take no job)
-- ARGV[5] the job record key prefix   ARGV[6] quiet_ms
-- ARGV[7..6+T] minimum slots per tier
-- Returns {envelopes, expired, cancelled, malformed, wait_ms, jobs taken,
-- worker gone}: wait_ms > 0 means nothing was taken: come back after that
-- long; worker gone = 1: drop the credit.
local inflight, stats, doorbell, cancelled_set = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local ready, jobs_queued = KEYS[6], KEYS[7]
local n = tonumber(ARGV[1])
local now = tonumber(ARGV[2])
local min_interval = tonumber(ARGV[3])
local headroom = tonumber(ARGV[4])
local job_prefix = ARGV[5]
local quiet_ms = tonumber(ARGV[6])
local first_queue = 9
if redis.call('EXISTS', KEYS[8]) == 0 then return {{}, 0, 0, 0, 0, 0, 1} end
local ntiers = (#KEYS - first_queue + 1) / 2
local first_job_queue = first_queue + ntiers
local taken, expired, cancelled, malformed, jobs_taken = {}, 0, 0, 0, 0
local last = tonumber(redis.call('GET', KEYS[5]) or '0')

if min_interval > 0 then
  local wait = last + min_interval - now
  if wait > 0 then
    local queued = 0
    for i = 1, ntiers do queued = queued + redis.call('LLEN', KEYS[first_queue + i - 1]) end
    if queued > 0 and queued < n then return {taken, 0, 0, 0, wait, 0, 0} end
  end
end
local check_cancelled = redis.call('ZCARD', cancelled_set) > 0

local function left_queue(env, status)
  -- a job leaving its queue: its key's count, and its record's status
  if env.job ~= true then return end
  if type(env.key_id) == 'string' then
    if redis.call('HINCRBY', jobs_queued, env.key_id, -1) <= 0 then
      redis.call('HDEL', jobs_queued, env.key_id)
    end
  end
  if redis.call('EXISTS', job_prefix .. env.id) == 1 then
    redis.call('HSET', job_prefix .. env.id, 'status', status, 'started_ms', now)
  end
end

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
      left_queue(env, 'expired')
    elseif check_cancelled and redis.call('ZSCORE', cancelled_set, env.id) then
      cancelled = cancelled + 1
      redis.call('ZREM', cancelled_set, env.id)
    else
      redis.call('RPUSH', inflight, raw)
      taken[#taken + 1] = raw
      got = got + 1
      if env.job == true then
        jobs_taken = jobs_taken + 1
        left_queue(env, 'running')
      end
    end
  end
end

for i = 1, ntiers do
  local share = tonumber(ARGV[6 + i]) or 0
  if share > 0 then pop_from(KEYS[first_queue + i - 1], share) end
end
for i = 1, ntiers do
  pop_from(KEYS[first_queue + i - 1], n)
end
if #taken < n and headroom >= 0 and (#taken > 0 or now - last >= quiet_ms
    or redis.call('LLEN', ready) >= headroom) then
  for i = 1, ntiers do pop_from(KEYS[first_job_queue + i - 1], n) end
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
return {taken, expired, cancelled, malformed, 0, jobs_taken, 0}
