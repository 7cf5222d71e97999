-- take_pop: forming a batch out of the queues, as every take entry shares it.
-- Each tier first gets its minimum share of the batch (if it has work), then the
-- rest is filled in strict priority order; within a tier, a requeue's list
-- (queue:{tier}, also an earlier version's) first, then the fair queue (fq:{tier})
-- in start-tag order, whose virtual time becomes the tag of the last one read;
-- a key's fair state goes once it has nothing waiting (its finish tag only once
-- the virtual time has reached it), and the tier's once nothing of it waits. Jobs
-- come after every synchronous request, by tier: they fill what synchronous work
-- leaves, and make a batch of their own only while `headroom` other workers are
-- idle, or once no synchronous batch was handed off for quiet_ms. A queue read
-- short is not read again (t.drained).
-- Needs take_envelope.lua. Put before the take entries (scripts.py).
local TAKE_KEYS = 6  -- KEYS[1..6], every take's: then the entry's own, then the tiers'

local function new_take(KEYS, ARGV, own_keys)
  -- The take of an entry with `own_keys` keys of its own after the six every
  -- take has (stats, doorbell, cancelled, last-dispatch, ready,
  -- jobs-queued); then 6T keys: queue:, jobs:, fq:, fair:, jfq:, jfair:
  -- of each tier, highest first. ARGV[1..5]: now, the credit, the batch id, its former,
  -- the model's key prefix. Past a deadline or not is judged on Redis's
  -- clock when the script runs (a call that waited would start a job
  -- enqueued after `now` past its deadline).
  local time = redis.call('TIME')
  local now = tonumber(ARGV[1])
  local t = {stats = KEYS[1], doorbell = KEYS[2], cancelled_set = KEYS[3],
    last_dispatch = KEYS[4], ready = KEYS[5], jobs_queued = KEYS[6],
    now = now, now_text = ARGV[1], live_at = math.max(now, tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)),
    credit = ARGV[2], batch_id = ARGV[3], former = ARGV[4], prefix = ARGV[5],
    job_prefix = string.match(ARGV[5], '^{[^}]*}:') .. 'job:', input_prefix = ARGV[5] .. 'input:',
    queues = {}, job_queues = {}, fair_queues = {}, fair_states = {}, job_fair_queues = {},
    job_fair_states = {}, taken = {}, expired = 0, cancelled = 0, malformed = 0, jobs = 0,
    drained = {}}
  local first = TAKE_KEYS + own_keys + 1
  t.ntiers = (#KEYS - first + 1) / 6
  local nt = t.ntiers
  for i = 1, nt do
    t.queues[i], t.job_queues[i] = KEYS[first + i - 1], KEYS[first + nt + i - 1]
    t.fair_queues[i], t.fair_states[i] = KEYS[first + 2 * nt + i - 1], KEYS[first + 3 * nt + i - 1]
    t.job_fair_queues[i] = KEYS[first + 4 * nt + i - 1]
    t.job_fair_states[i] = KEYS[first + 5 * nt + i - 1]
  end
  return t
end

-- The keys a take writes besides the queues, by the type it writes them as.
local TAKE_KINDS = {stats = 'hash', cancelled_set = 'zset', ready = 'list',
  jobs_queued = 'hash', last_dispatch = 'string'}

local function wrong_type(reply)
  -- a pcall's reply is WRONGTYPE (planted); any other error is raised
  if type(reply) ~= 'table' or not reply.err then return false end
  return string.find(reply.err, 'WRONGTYPE', 1, true) ~= nil or error(reply)
end

local function planted_gone(t)
  -- each of those of another type (planted) goes before anything moves (a
  -- write refused after envelopes were popped would lose them)
  for field, kind in pairs(TAKE_KINDS) do
    local found = redis.call('TYPE', t[field])['ok']
    if found ~= kind and found ~= 'none' then redis.call('DEL', t[field]) end
  end
end

local function pop_from(t, queue, limit)
  -- the oldest envelopes, a chunk at a time (no more than could be taken,
  -- so each one read leaves the queue), trimmed off together; a queue
  -- found short is not read again in this take (t.drained); one of another
  -- type (planted) goes, counted
  local got = 0
  while got < limit and #t.taken < t.n and not t.drained[queue] do
    local want = math.min(limit - got, t.n - #t.taken)
    local chunk = redis.pcall('LRANGE', queue, -want, -1)
    if wrong_type(chunk) then
      redis.call('DEL', queue)
      t.malformed, t.drained[queue] = t.malformed + 1, true
      break
    end
    if #chunk < want then t.drained[queue] = true end
    if #chunk == 0 then break end
    for j = #chunk, 1, -1 do got = got + consider(t, chunk[j]) end
    redis.call('LTRIM', queue, 0, -(#chunk + 1))
  end
  return got
end

local function left_fair_queue(state, left, v)
  -- the keys whose requests left a tier's fair queue: their waiting counts
  -- down; a key with none left leaves the tier's active weight, and its
  -- finish tag goes unless it is past the virtual time `v` (it was served
  -- ahead of its share: forgotten, its next request would start at `v`,
  -- ahead again; a planted value that is no finite number counts as none)
  for key, gone in pairs(left) do
    local name = 'n:' .. key
    local waiting = (finite(redis.call('HGET', state, name)) or 0) - gone
    if waiting > 0 then
      redis.call('HSET', state, name, waiting)
    else
      local fields = redis.call('HMGET', state, 'w:' .. key, 'w', 'f:' .. key)
      local weight, total = finite(fields[1]) or 0, finite(fields[2]) or 0
      redis.call('HDEL', state, name, 'w:' .. key)
      if (finite(fields[3]) or 0) <= v then redis.call('HDEL', state, 'f:' .. key) end
      redis.call('HSET', state, 'w', math.max(total - weight, 0))
    end
  end
end

local function pop_fair(t, queue, state, limit)
  -- the lowest start tags of a fair queue (a tier's requests', or its
  -- jobs'), as pop_from; then its virtual time and its keys' counts
  local got, tag, left = 0, nil, {}
  while got < limit and #t.taken < t.n and not t.drained[queue] do
    local want = math.min(limit - got, t.n - #t.taken)
    local chunk = redis.pcall('ZRANGE', queue, 0, want - 1)
    if chunk.err then
      -- a key of another type (planted) is no tier's queue: it goes, counted
      redis.call('DEL', queue)
      t.malformed = t.malformed + 1
      t.drained[queue] = true
      break
    end
    if #chunk < want then t.drained[queue] = true end
    if #chunk == 0 then break end
    for j = 1, #chunk do
      local took, env = consider(t, chunk[j])
      got = got + took
      local key = env and env.key_id
      if type(key) == 'string' then left[key] = (left[key] or 0) + 1 end
    end
    tag = redis.call('ZSCORE', queue, chunk[#chunk])  -- (the last one's: scores cost)
    redis.call('ZREMRANGEBYRANK', queue, 0, #chunk - 1)
  end
  if tag == nil then return end
  local kind = redis.call('TYPE', state)['ok']  -- (another type than a hash: replaced)
  if redis.call('EXISTS', queue) == 0 or (kind ~= 'hash' and kind ~= 'none') then
    redis.call('DEL', state)  -- nothing waits: the tier's virtual time starts over
  else
    redis.call('HSET', state, 'v', tag)
    left_fair_queue(state, left, tonumber(tag))
  end
end

local function pop_tier(t, i, limit)
  local got = pop_from(t, t.queues[i], limit)
  if got < limit then pop_fair(t, t.fair_queues[i], t.fair_states[i], limit - got) end
end

local function pop_jobs(t, i, limit)
  local got = pop_from(t, t.job_queues[i], limit)
  if got < limit then pop_fair(t, t.job_fair_queues[i], t.job_fair_states[i], limit - got) end
end
