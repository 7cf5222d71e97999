-- take: form a batch for the worker whose credit this dispatcher holds, and
-- hand it off, in one step: up to n live envelopes out of the tier queues,
-- oldest first within a tier, as one batch on the batches list, paid for by
-- the credit. Nothing sits between the queues and the batch, so nothing is
-- held by a dispatcher that dies. Each tier first gets its minimum share of
-- the batch (if it has work), then the rest is filled in strict priority
-- order (KEYS order). Envelopes past their deadline, cancelled, or
-- unreadable (not JSON, or without a numeric deadline_ms and string id,
-- gateway and input) are dropped here and counted: they never reach a
-- worker. If work is left behind, the doorbell rings again so another
-- dispatcher holding a credit wakes for it.
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
-- interval for a worker. A batch of jobs only does not count for pacing.
-- KEYS[1] credits:{dispatcher}  KEYS[2] stats  KEYS[3] doorbell
-- KEYS[4] cancelled (zset: request id -> expiry epoch ms)  KEYS[5] last-dispatch
-- KEYS[6] ready  KEYS[7] jobs-queued (hash: key id -> jobs queued)
-- KEYS[8] the heartbeat of the worker whose credit this dispatcher holds
-- KEYS[9] batches
-- KEYS[10..9+T] queue:{tier}, highest priority first; KEYS[10+T..9+2T] jobs:{tier}
-- Nothing is taken if the credit is no longer this dispatcher's (it stalled
-- past its heartbeat and the reaper returned the credit: a batch now would
-- run beside the one another dispatcher forms with it), or if its worker's
-- heartbeat is gone (it stopped or died while its credit was held: a batch
-- for it would wait for another worker).
-- ARGV[1] n   ARGV[2] now (epoch ms)   ARGV[3] min_interval_ms
-- ARGV[4] headroom (idle workers a jobs-only batch must leave; -1: take no job)
-- ARGV[5] the job record key prefix   ARGV[6] quiet_ms
-- ARGV[7] the credit (worker id)  ARGV[8] the batch id  ARGV[9] the dispatcher id
-- ARGV[10] '1' to return the batch's envelopes (for tracing), '0' not to
-- ARGV[11..10+T] minimum slots per tier
-- Returns {envelopes (if asked), expired, cancelled, malformed, wait_ms,
-- jobs taken, worker gone, batch size, credit lost}: wait_ms > 0 means
-- nothing was taken: come back after that long; worker gone = 1: drop the
-- credit; credit lost = 1: it is not this dispatcher's any more.
local credits, stats, doorbell, cancelled_set = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local ready, jobs_queued = KEYS[6], KEYS[7]
local n = tonumber(ARGV[1])
local now = tonumber(ARGV[2])
local min_interval = tonumber(ARGV[3])
local headroom = tonumber(ARGV[4])
local job_prefix = ARGV[5]
local quiet_ms = tonumber(ARGV[6])
local credit = ARGV[7]
local first_queue = 10
if redis.call('LPOS', credits, credit) == false then return {{}, 0, 0, 0, 0, 0, 0, 0, 1} end
if redis.call('EXISTS', KEYS[8]) == 0 then return {{}, 0, 0, 0, 0, 0, 1, 0, 0} end
local ntiers = (#KEYS - first_queue + 1) / 2
local first_job_queue = first_queue + ntiers
local taken, expired, cancelled, malformed, jobs_taken = {}, 0, 0, 0, 0
local last = tonumber(redis.call('GET', KEYS[5]) or '0')

if min_interval > 0 then
  local wait = last + min_interval - now
  if wait > 0 then
    local queued = 0
    for i = 1, ntiers do queued = queued + redis.call('LLEN', KEYS[first_queue + i - 1]) end
    if queued > 0 and queued < n then return {taken, 0, 0, 0, wait, 0, 0, 0, 0} end
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
  local share = tonumber(ARGV[10 + i]) or 0
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
if #taken > 0 then
  -- The batch as wire.encode_batch writes it, the envelopes' bytes unchanged.
  local batch = '{"id":' .. cjson.encode(ARGV[8]) .. ',"dispatcher":' .. cjson.encode(ARGV[9])
    .. ',"formed_ms":' .. ARGV[2] .. ',"envelopes":[' .. table.concat(taken, ',') .. '],"attempt":0}'
  redis.call('LPUSH', KEYS[9], batch)
  redis.call('LREM', credits, 1, credit)
  redis.call('HINCRBY', stats, 'batches_formed', 1)
  redis.call('HINCRBY', stats, 'requests_batched', #taken)
  if jobs_taken < #taken then redis.call('SET', KEYS[5], ARGV[2], 'PX', 60000) end
end
local size = #taken
if ARGV[10] ~= '1' then taken = {} end
return {taken, expired, cancelled, malformed, 0, jobs_taken, 0, size, 0}
