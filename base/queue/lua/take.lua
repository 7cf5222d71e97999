-- take: form a batch, at the moment a worker can run it: up to n live
-- envelopes out of the tier queues, oldest first within a tier, as one
-- batch. Two callers:
--   a dispatcher holding an idle worker's credit ('dispatch'): the batch goes
--     onto the batches list, paid for by the credit, for that worker to pull;
--   a worker that serves several shards through one backend (gpu/gate.py),
--     idle on this shard, as the backend starts a call of another shard's
--     batch ('join'): its credit, on `ready` or held by a dispatcher (which
--     finds it gone, as after the reaper took it back), pays for a batch of
--     what waits here, onto its own hand-off list
--     (batches:{worker}), to run in that same call, which costs the backend
--     nothing more (pacing, which keeps workers free, does not hold it back);
--     with nothing to take, the credit is withdrawn (marked) for the call;
--     as the call ends ('withdrawn'), a withdrawn credit comes back: a
--     batch formed then, onto the hand-off list, or the credit onto `ready`;
--   a worker whose backend has just returned ('worker'): the next batch is
--     formed straight into its processing list (no credit, no dispatcher,
--     no pull), beside the batch just run, which leaves once its replies are
--     published (while the next one runs; for a small batch, in this step:
--     'ack'). With nothing to take (or pacing
--     says wait, or no dispatcher has published the batching rule), its
--     credit goes onto `ready` instead, for a dispatcher.
-- Nothing sits between the queues and the batch, so nothing is held by a
-- process that dies. Each tier first gets its minimum share of
-- the batch (if it has work), then the rest is filled in strict priority
-- order (KEYS order). Envelopes past their deadline, cancelled, or
-- unreadable (not JSON, or without a numeric deadline_ms, a string id and
-- gateway, and a string input or, for a long input kept beside the queue,
-- a null input and a string input_key) are dropped here and counted: they
-- never reach a worker; a dropped one's long input is deleted with it. (What
-- cjson reads but JSON does not, NaN or 0x10 or a raw tab in a string, does,
-- and so does an input string whose escapes are broken, as they are not read
-- (read_head): the batch's head gives each envelope's length, and the
-- worker drops that one alone, wire.decode_batch; one with a NUL byte is
-- dropped here.) If work is left behind, the doorbell
-- rings again so another dispatcher holding a credit wakes for it.
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
-- KEYS[1] credits:{dispatcher} ('dispatch') or processing:{worker} ('worker',
--   'join', 'withdrawn')
-- KEYS[2] stats  KEYS[3] doorbell
-- KEYS[4] cancelled (zset: request id -> expiry epoch ms)  KEYS[5] last-dispatch
-- KEYS[6] ready  KEYS[7] jobs-queued (hash: key id -> jobs queued)
-- KEYS[8] 'dispatch': the heartbeat of the worker whose credit this
--   dispatcher holds; otherwise the batching rule the dispatchers publish
--   (JSON: n, interval_ms, headroom, quiet_ms, min_slots)
-- KEYS[9] 'dispatch': batches:{worker}, the hand-off list of the worker whose
--   credit this dispatcher holds (that worker, and no other, runs the batch);
--   'worker': batches, the shared list the reaper's retried batches wait on;
--   'join' and 'withdrawn': batches:{worker}, its own hand-off list
-- KEYS[10] 'worker': the worker's last step (its token); 'join' and
--   'withdrawn': the mark of its withdrawn credit; 'dispatch': unused
-- KEYS[11..10+T] queue:{tier}, highest priority first; KEYS[11+T..10+2T] jobs:{tier}
-- KEYS[11+2T..10+3T] fq:{tier}; KEYS[11+3T..10+4T] fair:{tier}
-- Fair queuing inside a tier (admit.lua queues): a tier's requests wait in
-- fq:{tier}, scored by start tag (start-time fair queuing: a request's tag
-- is the later of the tier's virtual time and its key's last finish tag,
-- which its cost over its key's weight moves on), and are taken in tag
-- order: each key gets the tier's slots in proportion to its weight, by
-- cost, whatever the others send. The tier's virtual time becomes the tag
-- of the last one taken; a key's state (waiting count, weight, finish tag)
-- goes once it has nothing waiting, and the tier's once nothing of it waits.
-- queue:{tier} (a list) is taken before it: a requeue puts envelopes at its
-- front, and gateways of an earlier version queue there.
-- A dispatcher takes nothing if the credit is no longer its own (it stalled
-- past its heartbeat and the reaper returned the credit: a batch now would
-- run beside the one another dispatcher forms with it), or if its worker's
-- heartbeat is gone (it stopped or died while its credit was held: a batch
-- for it would wait for another worker).
-- ARGV[1] 'dispatch', 'dispatch+envelopes' (return the batch's envelopes,
--   for tracing), 'worker', 'join' or 'withdrawn'
-- ARGV[2] now (epoch ms)  ARGV[3] the credit (worker id)  ARGV[4] the batch id
-- ARGV[5] who forms it (the dispatcher's id, or the worker's)
-- ARGV[6] the model's key prefix ('{ns}:' or '{ns}:m:{model}:': long inputs
--   are under its 'input:'; job records under the deployment's 'job:',
--   '{ns}:job:', whatever the model)
-- ARGV[7] 'worker': the batch just run (as pulled); 'join': how long the
--   mark of a withdrawn credit lasts (ms: a worker that stops before it
--   gives the credit back offers it again after that); 'dispatch': unused
-- ARGV[8] 'worker': this step's token, the same when the step is repeated;
--   'join': the most the batch may hold (the room left in the call);
--   'dispatch': unused
-- ARGV[9] 'worker': 'ack' to take the batch just run off processing in the
--   same step (its replies are published in the same transaction); 'dispatch':
--   unused
-- 'dispatch' only (a worker reads them from KEYS[8]):
-- ARGV[10] n  ARGV[11] min_interval_ms
-- ARGV[12] headroom (idle workers a jobs-only batch must leave; -1: take no job)
-- ARGV[13] quiet_ms  ARGV[14..13+T] minimum slots per tier
-- Returns {envelopes (if asked), expired, cancelled, malformed, wait_ms,
-- jobs taken, worker gone, batch size, credit lost, the batch ('worker') or
-- false}: wait_ms > 0 means a dispatcher took nothing: come back after that
-- long; worker gone = 1: drop the credit; credit lost = 1: it is not this
-- dispatcher's any more ('dispatch'), or the batch just run was gone and
-- nothing is in hand, so whether the worker's credit is out is unknown
-- ('worker').
local mode = ARGV[1]
local for_worker = mode == 'worker'
local withdrawn = mode == 'withdrawn'
local joining = mode == 'join'
local own, stats, doorbell, cancelled_set = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local ready, jobs_queued, batches = KEYS[6], KEYS[7], KEYS[9]
local now = tonumber(ARGV[2])
-- Past its deadline or not is judged when this script runs, on Redis's
-- clock (the fleet's: base/clock.py): `now` was read before the call, and a
-- call that waited would start a job enqueued after that reading, past its
-- deadline. (Redis 5+ replicates a script's effects: TIME may precede writes.)
local time = redis.call('TIME')
local live_at = math.max(now, tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000))
local credit = ARGV[3]
local job_prefix = string.match(ARGV[6], '^{[^}]*}:') .. 'job:'
local input_prefix = ARGV[6] .. 'input:'
local first_queue = 11
local ntiers = (#KEYS - first_queue + 1) / 4
local first_job_queue = first_queue + ntiers
local first_fair = first_queue + 2 * ntiers
local first_state = first_queue + 3 * ntiers

local function result(size, wait, gone, lost, batch)
  return {{}, 0, 0, 0, wait, 0, gone, size, lost, batch}
end

local function ring_if_waiting(first, also)
  -- ring the doorbell (kept at one ring) if any of the tier queues from
  -- KEYS[first] on (or from KEYS[also] on) holds work
  for i = 1, ntiers do
    if redis.call('EXISTS', KEYS[first + i - 1]) == 1
        or (also and redis.call('EXISTS', KEYS[also + i - 1]) == 1) then
      redis.call('LPUSH', doorbell, '1')
      redis.call('LTRIM', doorbell, 0, 0)
      return
    end
  end
end

local function offer_credit()
  -- the worker's credit onto `ready`, once; with jobs waiting, ring the
  -- doorbell (a dispatcher waiting for headroom to run them may have it now)
  redis.call('LREM', ready, 0, credit)
  redis.call('LPUSH', ready, credit)
  ring_if_waiting(first_job_queue)
end

local n, min_interval, headroom, quiet_ms, min_slots
if joining then
  -- Only a live worker's credit (it may have left since it was asked: a
  -- batch for it would wait for no one), and only one not spent: on
  -- `ready`, or held by a dispatcher (named from the prefix, as every
  -- dispatcher's: members:dispatcher).
  if redis.call('EXISTS', ARGV[6] .. 'hb:worker:' .. credit) == 0 then
    return result(0, 0, 0, 1, false)
  end
  local found = redis.call('LREM', ready, 0, credit)
  if found == 0 then
    local dispatchers = redis.pcall('SMEMBERS', ARGV[6] .. 'members:dispatcher')
    for _, id in ipairs(dispatchers.err and {} or dispatchers) do
      local held = redis.pcall('LREM', ARGV[6] .. 'credits:' .. id, 0, credit)
      if type(held) == 'number' then found = found + held end
    end
  end
  if found == 0 then return result(0, 0, 0, 1, false) end
  local kind = redis.call('TYPE', batches)['ok']
  n, min_interval, headroom, quiet_ms, min_slots = published_rule(KEYS[8], ntiers)  -- rule.lua
  if n == nil or (kind ~= 'list' and kind ~= 'none') then
    redis.call('SET', KEYS[10], '1', 'PX', ARGV[7])
    return result(0, 0, 0, 0, false)
  end
  n, min_interval = math.min(n, math.max(math.floor(tonumber(ARGV[8]) or 0), 0)), 0
elseif withdrawn then
  -- The credit comes back once (the mark goes first), to a live worker,
  -- and only if it is still out of everyone's hands: not back on `ready`
  -- (offered again), not spent on a batch on its hand-off list (the worker
  -- offers it when that one has run). (A batch in processing is as a rule
  -- the last one, its answer still going out, whose take offered the
  -- credit withdrawn; one pulled from the shared list meanwhile took the
  -- mark away, pull_waiting.lua.)
  if redis.call('DEL', KEYS[10]) == 0 then return result(0, 0, 0, 0, false) end
  if redis.call('EXISTS', ARGV[6] .. 'hb:worker:' .. credit) == 0 then
    return result(0, 0, 0, 1, false)
  end
  -- (a hand-off list of another type: written after envelopes leave their
  -- queues, so nothing is taken for it; the credit goes back)
  local kind = redis.call('TYPE', batches)['ok']
  if kind ~= 'list' and kind ~= 'none' then
    offer_credit()
    return result(0, 0, 0, 0, false)
  end
  if redis.call('LPOS', ready, credit) or redis.call('LLEN', batches) > 0 then
    return result(0, 0, 0, 0, false)
  end
  n, min_interval, headroom, quiet_ms, min_slots = published_rule(KEYS[8], ntiers)  -- rule.lua
  if n == nil then
    offer_credit()
    return result(0, 0, 0, 0, false)
  end
elseif for_worker then
  -- The batch just run is still in processing (it leaves when its replies
  -- are published). A step whose token is the last step's was run before
  -- (its reply was lost); a step that finds anything else in processing
  -- was too, or the reaper took the batch. Either way, whatever is there
  -- beside it is the answer again, and nothing more is formed or offered
  -- (the first run offered the credit if it formed nothing).
  -- (a token key of another type is no token: the SET below replaces it)
  local repeated = redis.pcall('GET', KEYS[10]) == ARGV[8]
  -- The batch just run alone there is found by LPOS, without reading it
  -- into the script (a string made in a script costs about a nanosecond a
  -- byte: a batch of long inputs is megabytes).
  if repeated or redis.call('LLEN', own) ~= 1 or redis.call('LPOS', own, ARGV[7]) ~= 0 then
    local held = redis.call('LRANGE', own, 0, 2)
    local following = false
    for _, b in ipairs(held) do
      if b ~= ARGV[7] then following = b break end
    end
    -- Its replies go out in this transaction whatever is found here: a
    -- first run (something else was in processing: left there by a Redis
    -- restored from disk, or planted) still takes it off.
    if ARGV[9] == 'ack' and not repeated then redis.call('LREM', own, 0, ARGV[7]) end
    -- nothing in hand, and not known to have offered the credit: 'credit
    -- lost' tells the worker to make sure it is out (ensure_credit.lua;
    -- never a second one)
    return result(0, 0, 0, (following or repeated) and 0 or 1, following)
  end
  -- No TTL: a repeat is known however long it comes after (the reaper
  -- and a clean exit delete it).
  redis.call('SET', KEYS[10], ARGV[8])
  if ARGV[9] == 'ack' then redis.call('LREM', own, 0, ARGV[7]) end
  -- A batch already waiting is run first: one handed off with this
  -- worker's credit while it ran a retried batch (its credit was still out),
  -- else one the reaper retried. No credit is offered for it: one offered
  -- "in its place" would most often be one too many, and keep a batch
  -- formed ahead of every worker.
  local waiting = redis.call('LMOVE', ARGV[6] .. 'batches:' .. credit, own, 'RIGHT', 'LEFT')
    or redis.call('LMOVE', batches, own, 'RIGHT', 'LEFT')
  if waiting then return result(0, 0, 0, 0, waiting) end
  n, min_interval, headroom, quiet_ms, min_slots = published_rule(KEYS[8], ntiers)  -- rule.lua
  if n == nil then
    offer_credit()
    return result(0, 0, 0, 0, false)
  end
else
  if redis.call('LPOS', own, credit) == false then return result(0, 0, 0, 1, false) end
  if redis.call('EXISTS', KEYS[8]) == 0 then return result(0, 0, 1, 0, false) end
  -- (its hand-off list is written after envelopes leave their queues, and
  -- a script's writes are not undone: a key of another type there, the
  -- credit is dropped as a gone worker's, before anything is taken)
  local kind = redis.call('TYPE', batches)['ok']
  if kind ~= 'list' and kind ~= 'none' then return result(0, 0, 1, 0, false) end
  n, min_interval = math.floor(tonumber(ARGV[10])), tonumber(ARGV[11])
  headroom, quiet_ms = tonumber(ARGV[12]), tonumber(ARGV[13])
  min_slots = {}
  for i = 1, ntiers do min_slots[i] = math.floor(tonumber(ARGV[13 + i]) or 0) end
end
local taken, expired, cancelled, malformed, jobs_taken = {}, 0, 0, 0, 0
-- The last hand-off, as the clock of whoever made it said; one from a clock
-- ahead of ours holds pacing back by at most one interval, not by the skew.
local last = math.min(tonumber(redis.call('GET', KEYS[5])) or 0, now)

if min_interval > 0 then
  local wait = last + min_interval - now
  if wait > 0 then
    local queued = 0
    for i = 1, ntiers do
      local fair = redis.pcall('ZCARD', KEYS[first_fair + i - 1])
      queued = queued + redis.call('LLEN', KEYS[first_queue + i - 1])
        + (type(fair) == 'number' and fair or 0)
    end
    if queued > 0 and queued < n then
      if for_worker or withdrawn then offer_credit() return result(0, 0, 0, 0, false) end
      return result(0, wait, 0, 0, false)
    end
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
  -- (a record is a hash; a key planted under its name is left alone)
  if redis.call('TYPE', job_prefix .. env.id)['ok'] == 'hash' then
    redis.call('HSET', job_prefix .. env.id, 'status', status, 'started_ms', live_at)
  end
end

local function drop_input(env)
  -- a dropped request's long input (queue/inputs.py) goes with it; only
  -- a key under the inputs' prefix (a planted envelope names no other)
  local key = env.input_key
  if type(key) == 'string' and string.sub(key, 1, #input_prefix) == input_prefix then
    redis.call('DEL', key)
  end
end

local function closes_at_end(raw, from)
  -- whether the JSON string opened just before `from` ends with the
  -- envelope, its closing quote followed by '}' alone: every quote before
  -- it is escaped (an odd run of backslashes before it)
  local at = from
  while true do
    local quote = string.find(raw, '"', at, true)
    if not quote then return false end
    local slashes = 0
    while string.byte(raw, quote - slashes - 1) == 92 do slashes = slashes + 1 end
    if slashes % 2 == 0 then return quote == #raw - 1 and string.byte(raw, -1) == 125 end
    at = quote + 1
  end
end

local function read_head(raw)
  -- An envelope as a gateway queues it (wire.encode_queued), read without
  -- decoding its input: every field but the input comes first, then
  -- ',"input":' (the first one is the field's: a JSON string holds no bare
  -- quote) and the input, null or one string that ends the object, last.
  -- Decoding the input too would make it a Lua string once more and cost
  -- more than all the rest (a 2 KB input: about 6 µs against 2). Nothing
  -- but the input follows the head, so the worker reads the fields checked
  -- here (a planted field repeated after the input would be the one it
  -- read); the input's escapes are not checked, and the worker drops an
  -- envelope they make unreadable, alone (wire.decode_batch). Anything else
  -- (an envelope of an earlier version, its input in the middle; one
  -- planted) reads nil: decoded whole.
  local at = string.find(raw, ',"input":', 1, true)
  if not at then return nil end
  local ok, env = pcall(cjson.decode, string.sub(raw, 1, at - 1) .. '}')
  if not ok or type(env) ~= 'table' or type(env.deadline_ms) ~= 'number' then return nil end
  if string.byte(raw, at + 9) == 34 and closes_at_end(raw, at + 10) then
    env.input = ''  -- (a string)
  elseif #raw == at + 13 and string.sub(raw, at + 9) == 'null}' then
    env.input = cjson.null
  else
    return nil
  end
  return env
end

local function consider(raw)
  -- one envelope off a queue: taken (1), or dropped and counted (0); and
  -- what it read of it, if it was an object (its key's count goes down in
  -- a fair queue, taken or dropped: pop_fair). (cjson stops
  -- reading at a NUL byte: what followed one, anything at all, would go
  -- into the batch unread. JSON escapes a NUL, so none is in an envelope.)
  local ok, env = false, nil
  if not string.find(raw, '\0', 1, true) then
    env = read_head(raw)
    ok = env ~= nil
    if not ok then ok, env = pcall(cjson.decode, raw) end
  end
  if not ok or type(env) ~= 'table' or type(env.deadline_ms) ~= 'number'
      or type(env.id) ~= 'string' or type(env.gateway) ~= 'string'
      or not (type(env.input) == 'string'
        or (env.input == cjson.null and type(env.input_key) == 'string')) then
    malformed = malformed + 1
  elseif env.deadline_ms <= live_at then
    expired = expired + 1
    left_queue(env, 'expired')
    drop_input(env)
  elseif check_cancelled and redis.call('ZSCORE', cancelled_set, env.id) then
    cancelled = cancelled + 1
    redis.call('ZREM', cancelled_set, env.id)
    drop_input(env)
  else
    taken[#taken + 1] = raw
    if env.job == true then
      jobs_taken = jobs_taken + 1
      left_queue(env, 'running')
    end
    return 1, env
  end
  return 0, ok and type(env) == 'table' and env or nil
end

local function joined16(list, i, j)
  -- list[i..j], at most 16 strings, in one concatenation
  local s = {}
  for k = 1, 16 do
    local at = i + k - 1
    s[k] = at <= j and list[at] or ''
  end
  return s[1] .. s[2] .. s[3] .. s[4] .. s[5] .. s[6] .. s[7] .. s[8] .. s[9] .. s[10]
    .. s[11] .. s[12] .. s[13] .. s[14] .. s[15] .. s[16]
end

local function joined(list)
  -- table.concat(list). For a long result, in two concatenations (groups
  -- of 16, then the groups: each byte copied twice): table.concat makes it
  -- through a string per 8 KB and merges of those, each byte copied several
  -- times over (a batch of 91 inputs of 16,000 characters: 6.3 ms of Redis,
  -- against 3.6). (A worker's batch is at most 100 envelopes.)
  local bytes = 0
  for k = 1, #list do bytes = bytes + #list[k] end
  if bytes < 65536 or #list > 256 then return table.concat(list) end
  local groups = {}
  for i = 1, #list, 16 do groups[#groups + 1] = joined16(list, i, math.min(i + 15, #list)) end
  return joined16(groups, 1, #groups)
end

local function pop_from(queue, limit)
  -- The oldest envelopes are read a chunk at a time (no more than could be
  -- taken, so each one read leaves the queue) and trimmed off together.
  -- Returns how many were taken.
  local got = 0
  while got < limit and #taken < n do
    local chunk = redis.call('LRANGE', queue, -math.min(limit - got, n - #taken), -1)
    if #chunk == 0 then break end
    for j = #chunk, 1, -1 do got = got + consider(chunk[j]) end
    redis.call('LTRIM', queue, 0, -(#chunk + 1))
  end
  return got
end

local function count_of(raw)
  -- a count in a fair state, or 0 if it is no finite number (planted)
  local value = tonumber(raw)
  if value == nil or value ~= value or math.abs(value) == math.huge then return 0 end
  return value
end

local function left_fair_queue(state, left)
  -- the keys whose requests left a tier's fair queue: their waiting counts
  -- down; a key with none left waiting leaves the tier's active weight
  -- (read and written whole: a planted value that is no finite number
  -- counts as none)
  for key, count in pairs(left) do
    local name = 'n:' .. key
    local waiting = count_of(redis.call('HGET', state, name)) - count
    if waiting > 0 then
      redis.call('HSET', state, name, waiting)
    else
      local weight = count_of(redis.call('HGET', state, 'w:' .. key))
      local total = count_of(redis.call('HGET', state, 'w'))
      redis.call('HDEL', state, name, 'w:' .. key, 'f:' .. key)
      redis.call('HSET', state, 'w', math.max(total - weight, 0))
    end
  end
end

local function pop_fair(i, limit)
  -- The lowest start tags of tier i's fair queue, a chunk at a time, as
  -- pop_from; then the tier's virtual time and its keys' counts.
  local queue, state = KEYS[first_fair + i - 1], KEYS[first_state + i - 1]
  local got, tag, left = 0, nil, {}
  while got < limit and #taken < n do
    local chunk = redis.pcall('ZRANGE', queue, 0, math.min(limit - got, n - #taken) - 1, 'WITHSCORES')
    if chunk.err then
      -- a key of another type (planted) is no tier's queue: it goes, and
      -- is counted, so it does not stop every batch
      redis.call('DEL', queue)
      malformed = malformed + 1
      break
    end
    if #chunk == 0 then break end
    for j = 1, #chunk, 2 do
      local took, env = consider(chunk[j])
      got, tag = got + took, chunk[j + 1]
      local key = env and env.key_id
      if type(key) == 'string' then left[key] = (left[key] or 0) + 1 end
    end
    redis.call('ZREMRANGEBYRANK', queue, 0, #chunk / 2 - 1)
  end
  if tag == nil then return got end
  -- (a state of another type than a hash is not this script's: replaced)
  local kind = redis.call('TYPE', state)['ok']
  if redis.call('EXISTS', queue) == 0 or (kind ~= 'hash' and kind ~= 'none') then
    redis.call('DEL', state)  -- nothing waits: the tier's virtual time starts over
  else
    redis.call('HSET', state, 'v', tag)
    left_fair_queue(state, left)
  end
  return got
end

local function pop_tier(i, limit)
  -- a tier's requests: a requeue's front (and an earlier version's queue)
  -- first, then in fair order
  local got = pop_from(KEYS[first_queue + i - 1], limit)
  if got < limit then pop_fair(i, limit - got) end
end

for i = 1, ntiers do
  if min_slots[i] > 0 then pop_tier(i, min_slots[i]) end
end
for i = 1, ntiers do
  pop_tier(i, n)
end
if #taken < n and headroom >= 0 and (#taken > 0 or now - last >= quiet_ms
    or redis.call('LLEN', ready) >= headroom) then
  for i = 1, ntiers do pop_from(KEYS[first_job_queue + i - 1], n) end
end

if expired > 0 then redis.call('HINCRBY', stats, 'expired_dropped', expired) end
if cancelled > 0 then redis.call('HINCRBY', stats, 'cancelled_dropped', cancelled) end
if malformed > 0 then redis.call('HINCRBY', stats, 'malformed_dropped', malformed) end
if check_cancelled then redis.call('ZREMRANGEBYSCORE', cancelled_set, '-inf', now) end

if n > 0 and #taken >= n then ring_if_waiting(first_queue, first_fair) end
local batch = false
if #taken > 0 then
  -- The batch's frame, as wire.encode_batch writes it: its head on a line,
  -- with each envelope's length, then the envelopes' bytes unchanged, so no
  -- byte of an envelope is ever read to find where it ends.
  local lengths = {}
  for k = 1, #taken do lengths[k] = #taken[k] end
  local head = 'infergate-batch/2\n{"id":' .. cjson.encode(ARGV[4]) .. ',"dispatcher":'
    .. cjson.encode(ARGV[5]) .. ',"formed_ms":' .. ARGV[2] .. ',"attempt":0,"lengths":['
    .. table.concat(lengths, ',') .. ']}\n'
  local first = taken[1]
  taken[1] = head .. first  -- (onto the first envelope: the batch is not copied once more)
  batch = joined(taken)
  taken[1] = first
  if for_worker then
    redis.call('LPUSH', own, batch)
  elseif withdrawn or joining then
    redis.call('LPUSH', batches, batch)
    batch = false
  else
    redis.call('LPUSH', batches, batch)
    redis.call('LREM', own, 1, credit)
    batch = false
  end
  redis.call('HINCRBY', stats, 'batches_formed', 1)
  redis.call('HINCRBY', stats, 'requests_batched', #taken)
  if jobs_taken < #taken then redis.call('SET', KEYS[5], ARGV[2], 'PX', 60000) end
elseif for_worker or withdrawn then
  offer_credit()
elseif joining then
  redis.call('SET', KEYS[10], '1', 'PX', ARGV[7])
end
local size = #taken
if mode ~= 'dispatch+envelopes' then taken = {} end
return {taken, expired, cancelled, malformed, 0, jobs_taken, 0, size, 0, batch}
