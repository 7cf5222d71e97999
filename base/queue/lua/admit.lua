-- admit: charge a request to its key's limits and, if every limit has room
-- and its key's share of the tier has room, queue its envelope and ring the
-- doorbell: one step, one round trip.
-- Each limit is a sliding window of ten buckets: a hash (field: the bucket's
-- index, t * 10 // window; value: what was charged in it) that holds every
-- bucket overlapping the last window (eleven: the oldest one in full), with
-- their sum ('s') as of the newest bucket ('l'): a request reads four fields
-- (and, once a bucket, the ones that left) and writes two, in two commands. A
-- request is admitted while the eleven buckets' sum plus its cost stays
-- within the limit plus a tenth (floor), and the last ten buckets' within the
-- limit: every span of one window lies inside the eleven buckets counted when
-- the last request in it was admitted, so no such span is ever charged more
-- than 110 % of the limit; a burst gets the limit, no more; and a client that
-- keeps exactly to its rate is never refused. Time is Redis's (TIME), so every
-- gateway judges on one clock. A request refused by any check is charged to
-- none: the windows only ever hold what was admitted, across every gateway,
-- and a refusal has nothing to refund. A window that is not a hash of
-- integers (Redis contents are not trusted) starts again, empty.
-- A refund is a charge of minus the cost (always made).
-- A key's share of its tier: the gateway says how many of the tier's
-- requests can wait within its latency budget (the allowance; 0: no check);
-- a key may have waiting at most its weight's share of that, among the keys
-- with requests waiting (itself included), or those the gateway admitted in
-- the last second if more (a key with nothing waiting now still takes its
-- share of the slots: counting only the waiting ones would let a flooding key
-- queue what the others' arrivals then delay past the budget); a key whose
-- share is under one request may have one waiting while the tier holds less
-- than the allowance. A key that floods its tier is refused there while the
-- others are not.
-- Queued in fair order (take.lua): the request's start tag is the later of
-- the tier's virtual time and its key's last finish tag; its finish tag is
-- the start plus its cost over its key's weight.
-- Handed straight to an idle worker: a request admitted while nothing at all
-- is queued, an idle worker's credit is on `ready` (not held by a
-- dispatcher) and pacing would not hold it back, is formed into a batch of
-- its own here and handed off with that credit, as a dispatcher's take
-- would do the moment the doorbell woke it (take.lua: the same batch, rule
-- and counts), one hop and one round trip sooner. Anything queued ahead of
-- it (it could be of a higher tier, or jobs a batch would take along), no
-- published batching rule, or no live idle worker: it is queued as usual.
-- A long input is kept beside its envelope (queue/inputs.py): the gateway
-- writes it just before the call (no script makes it a string), and the
-- call deletes it if its request is refused; a request whose SET Redis
-- refused fails (and the gateway deletes the inputs of a call refused
-- whole, queue/admits.py).
-- One call admits every request a gateway gathered in one moment
-- (queue/admits.py), each in turn as if it came alone, with one clock
-- reading: ARGV[1] how many (m); ARGV[2i], ARGV[2i+1] request i's number of
-- keys and of arguments; then its keys in KEYS and its arguments in ARGV
-- (after the first 2m + 1), one request after another. A request that
-- fails (a step's error) fails alone: its reply is the error's text.
-- A request's keys and arguments (KEYS and ARGV below):
-- KEYS[1..n] the windows  KEYS[n+1] fq:{tier}  KEYS[n+2] doorbell
--   KEYS[n+3] fair:{tier}  (without those three: charge only)
-- KEYS[n+4] the input's key, when one is kept beside (ARGV[3n+3] is 1 or 2)
-- ARGV[1] n  ARGV[2] the envelope (when queued)
-- ARGV[3i], ARGV[3i+1], ARGV[3i+2] limit i's cost, amount and window (s)
-- ARGV[3n+3] 1 if its input is kept beside (0: in the envelope; 2: kept
--   beside but held back, the gateway expecting a refusal: admitted, it is
--   answered 3 and nothing is done, and the gateway sends it again with
--   its input)
-- ARGV[3n+4..3n+8] the key's id, the request's cost, the key's weight (in
--   thousandths), the tier's allowance (requests; 0: no share check), the
--   weights (thousandths) of the keys the gateway admitted in the last second
-- ARGV[3n+9..3n+13] (to hand it straight) the batch id, who forms it (the
--   gateway), now (epoch ms), the model's key prefix and its tiers (names,
--   space-separated, highest first). The keys it reads then are named from
--   the prefix (Keys in keys.py), not sent with every request: ready,
--   batch-rule, last-dispatch, stats, every queue:{tier}, jobs:{tier} and
--   fq:{tier}, the workers' heartbeats, and batches:{worker} of the worker
--   whose credit paid for it (that worker, and no other, runs it).
-- Returns {admitted (1; 0: over a limit; 2: over its key's share; 3: its
--          input held back, nothing done),
--          queued (1 or 0), handed straight (1 or 0),
--          count_1, ttl_ms_1, ..., count_n, ttl_ms_n, the first limit
--          without room (1-based; 0: none)}: a window's last ten
-- buckets' sum after the charge (before it, if refused), and the ms until it has room again
-- (refused) or until its oldest charge leaves it (-2: nothing charged).
-- Within one call, each window, each fair state and the doorbell is read
-- once and written once (at the end of the call): the requests after the
-- first read what the ones before them left, from the script's own copy.
-- No other command runs during a script, so what each request sees, and
-- what Redis holds once the call ends, is what one call a request would
-- see and leave; a call of many requests of few keys (a busy gateway's)
-- costs Redis a few commands a key, not a few a request.
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)

local windows = {}  -- a window's name -> what this call knows of it
local states = {}  -- a fair state's name -> its fields as this call left them
local rung = {}  -- a doorbell's name -> rung (or found ringing) in this call
local no_hand = {}  -- a model's prefix -> no request of it in this call can go straight

local function number(raw)
  -- a count as the script writes it (Redis writes a Lua number that is a
  -- whole number below 2^53 in digits: a window that grew past that starts
  -- over), or nil if it is not one (planted: text, '0x10', ' 5', '1e3',
  -- 'nan', or past 18 digits)
  if type(raw) == 'string' and not (#raw <= 18 and string.find(raw, '^%-?%d+$')) then
    return nil
  end
  return tonumber(raw)
end

local function finite(raw)
  -- a number, or nil if it is none, or not finite (a planted 'nan' or 'inf')
  local value = tonumber(raw)
  if value == nil or value ~= value or value == math.huge or value == -math.huge then
    return nil
  end
  return value
end

local function write_window(key, w)
  -- what this call charged to a window, written once
  local bucket = tostring(w.current)
  if w.new then
    redis.call('HSET', key, bucket, w.held, 's', w.eleven, 'l', bucket)
    redis.call('PEXPIRE', key, math.ceil(w.window_ms * 11 / 10) + 1000)
  else
    redis.call('HSET', key, bucket, w.held, 's', w.eleven)
  end
end

local function empty_window(current, window_ms)
  -- a window with nothing charged (new, or started over)
  return {current = current, window_ms = window_ms, eleven = 0, oldest = 0, held = 0,
    new = true, dirty = false}
end

local function read_window(key, current, window_ms)
  -- the window as of bucket `current`: the eleven buckets' sum, what the
  -- oldest of them holds (so the last ten's is the difference), whether the
  -- window is new, and what bucket `current` holds. The buckets that left
  -- since the sum was last moved on are deleted and taken off it, then and
  -- there (refused or not), and its expiry set again; a hash that cannot be
  -- read, or holds anything but counts there, starts over, empty.
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
  local last, sum = number(raw[1]), number(raw[2] or 0)
  local oldest, held = number(raw[3] or 0), number(raw[4] or 0)
  if last == nil or sum == nil or oldest == nil or held == nil or last > current then
    -- (one ahead of Redis's clock, which stepped back, would count until
    -- the clock reached it)
    redis.call('DEL', key)
    return empty_window(current, window_ms)
  end
  local w = {current = current, window_ms = window_ms, eleven = sum, oldest = oldest,
    held = held, new = false, dirty = false}
  if last == current then return w end
  -- (a charge in bucket b leaves the window at (b + 11) tenths: 1.1
  -- windows from the start of b at most)
  local expiry = math.ceil(window_ms * 11 / 10) + 1000
  -- buckets last - 10 .. current - 11 left the window (those past last are empty)
  local left = {}
  for index = last - 10, math.min(current - 11, last) do left[#left + 1] = tostring(index) end
  if #left > 0 then
    local amounts = redis.call('HMGET', key, unpack(left))
    for j = 1, #left do
      local amount = number(amounts[j] or 0)
      if amount == nil then
        redis.call('DEL', key)
        return empty_window(current, window_ms)
      end
      sum = sum - amount
    end
    redis.call('HDEL', key, unpack(left))
  end
  redis.call('HSET', key, 's', sum, 'l', tostring(current))
  redis.call('PEXPIRE', key, expiry)
  w.eleven = sum
  return w
end

local function window(key, window_ms)
  -- the window as this call knows it (read once; a window of the same name
  -- and another length, which a policy edit could send, is written back and
  -- read again)
  local current = math.floor(now * 10 / window_ms)
  local w = windows[key]
  if w and w.window_ms == window_ms then return w end
  if w and w.dirty then write_window(key, w) end
  w = read_window(key, current, window_ms)
  windows[key] = w
  return w
end

local function room(key, w, cost, amount)
  -- Whether a request of `cost` fits now; if not, the ms until it would
  -- (reading every bucket: only when refused; the current one as this call
  -- left it).
  local allowed = amount + math.floor(amount / 10)
  local eleven, current = w.eleven, w.current
  if eleven + cost <= allowed and eleven - w.oldest + cost <= amount then return true, 0 end
  local fields = {}
  for j = 1, 11 do fields[j] = tostring(current - 11 + j) end
  local amounts = redis.call('HMGET', key, unpack(fields))
  amounts[11] = w.held
  for later = 1, 11 do
    local e, t = 0, 0
    for j = 1 + later, 11 do
      local a = number(amounts[j] or 0) or 0
      e = e + a
      if j >= 2 + later then t = t + a end
    end
    if e + cost <= allowed and t + cost <= amount then
      return false, math.ceil((current + later) * w.window_ms / 10) - now
    end
  end
  return false, -1
end

local function fair_state(state, fq, key_id)
  -- a tier's fair state as this call left it, with `key_id`'s fields read
  -- (a state of another type is not this script's: it starts over; one
  -- whose queue is gone, deleted or evicted, is stale: it goes)
  local s = states[state]
  if s and s.keys[key_id] then return s end
  local fair = redis.pcall('HMGET', state, 'v', 'w', 'f:' .. key_id, 'n:' .. key_id, 'w:' .. key_id)
  if type(fair) ~= 'table' or fair.err then redis.call('DEL', state) fair = {} s = nil end
  if not s then
    s = {v = finite(fair[1]) or 0, w = math.max(finite(fair[2]) or 0, 0), keys = {}, dirty = {},
      queued = {}}
    states[state] = s
  end
  local mine = {f = finite(fair[3]) or 0, n = math.max(finite(fair[4]) or 0, 0),
    w = finite(fair[5])}
  if (mine.n > 0 or s.w > 0) and redis.call('EXISTS', fq) == 0 then
    redis.call('DEL', state)
    s.v, s.w, s.keys, s.dirty, s.queued = 0, 0, {}, {}, {}
    mine = {f = 0, n = 0}
  end
  s.keys[key_id] = mine
  return s
end

local function write_state(state, s)
  -- (a key that queued: its finish tag and its count, as the call left them)
  local pairs_ = {}
  for key_id, mine in pairs(s.queued) do
    pairs_[#pairs_ + 1] = 'f:' .. key_id
    pairs_[#pairs_ + 1] = mine.f  -- (a number: redis.call writes it in full)
    pairs_[#pairs_ + 1] = 'n:' .. key_id
    pairs_[#pairs_ + 1] = mine.n
  end
  for field, value in pairs(s.dirty) do
    pairs_[#pairs_ + 1] = field
    pairs_[#pairs_ + 1] = value
  end
  if #pairs_ > 0 then redis.call('HSET', state, unpack(pairs_)) end
end

local function pacing_interval(rule_key, ntiers)
  -- the published rule's pacing interval (ms; 0 when batches are of one,
  -- as take.lua never holds a full batch); nil if there is no rule that
  -- take.lua would read (published_rule: rule.lua)
  local batch_size, interval = published_rule(rule_key, ntiers)
  if batch_size == nil then return nil end
  return batch_size > 1 and interval or 0
end

local function hand_straight(ARGV, sa)
  -- the envelope as a batch of its own, to an idle worker; false if it
  -- must be queued instead
  local prefix = ARGV[sa + 3]
  local ready = prefix .. 'ready'
  -- (no idle worker first: under load, the one check made; nothing in a
  -- call puts one on `ready`, so no later request of the call looks again)
  if redis.call('LLEN', ready) == 0 then no_hand[prefix] = true return false end
  local rule_key, last_key, stats = prefix .. 'batch-rule', prefix .. 'last-dispatch', prefix .. 'stats'
  local ntiers = 0
  for tier in string.gmatch(ARGV[sa + 4], '%S+') do
    ntiers = ntiers + 1
    for _, kind in ipairs({'queue:', 'jobs:', 'fq:'}) do
      if redis.call('EXISTS', prefix .. kind .. tier) == 1 then return false end
    end
  end
  local interval = pacing_interval(rule_key, ntiers)
  if interval == nil then return false end
  local at = tonumber(ARGV[sa + 2])
  local last = math.min(tonumber(redis.pcall('GET', last_key)) or 0, at)
  if interval > 0 and last + interval > at then return false end
  -- Nothing after the credit is spent may fail (the envelope would be
  -- queued as well): the keys it writes are checked first.
  local stats_kind = redis.call('TYPE', stats)['ok']
  if stats_kind ~= 'hash' and stats_kind ~= 'none' then return false end
  -- The oldest idle live worker's credit, as a dispatcher would take it
  -- (idle_worker.lua); the batch goes to that worker's hand-off list.
  local _, handoff = idle_worker(ready, prefix .. 'hb:worker:', prefix .. 'batches:')
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

local function queue_fairly(fq, doorbell, state, s, key_id, envelope, cost, weight)
  -- onto the tier's fair queue at its start tag; its key's state after it
  -- (in this call's copy, written as the call ends)
  local mine = s.keys[key_id]
  local start = math.max(s.v, mine.f)
  local added = redis.pcall('ZADD', fq, start, envelope)
  if type(added) ~= 'number' then
    -- a key of another type (planted) is no tier's queue: it goes; any
    -- other error is raised, never a reason to delete a queue (not reached:
    -- out of memory is refused whole before this, by the call's write
    -- check below, and if it were, the request's charge would stand)
    if not string.find(tostring(added.err), 'WRONGTYPE', 1, true) then error(added) end
    redis.call('DEL', fq)
    redis.call('ZADD', fq, start, envelope)
  end
  -- (written from what was read, so a planted value that is no number
  -- counts as none, instead of failing the step)
  local ends = start + cost * 1000 / math.max(weight, 1)
  mine.f = ends
  if mine.n <= 0 then
    mine.w = weight
    s.w = s.w + weight
    s.dirty['w:' .. key_id] = weight
    s.dirty['w'] = s.w
  end
  mine.n = mine.n + 1
  s.queued[key_id] = mine
  -- (one ring is enough: a dispatcher that waits takes it at once)
  -- (a key of another type, planted, is no doorbell: it goes)
  if not rung[doorbell] then
    local rings = redis.pcall('LLEN', doorbell)
    if type(rings) ~= 'number' then redis.call('DEL', doorbell) rings = 0 end
    if rings == 0 then redis.call('LPUSH', doorbell, '1') end
    rung[doorbell] = true
  end
  return 1
end

local function over_share(ARGV, fa, fq, s, key_id, weight)
  -- whether the key already holds its weight's share of the tier's
  -- allowance (the weight it waits with: the policy may have changed it since)
  local allowance = tonumber(ARGV[fa + 3]) or 0
  if allowance <= 0 then return false end
  local mine = s.keys[key_id]
  local others = s.w - (mine.n > 0 and (mine.w or weight) or 0)
  local sharing = math.max(math.max(others, 0) + weight, tonumber(ARGV[fa + 4]) or 0)
  local share = math.floor(allowance * weight / sharing)
  if share < 1 then
    -- a share under one request: one while the tier has room, no more
    return mine.n >= 1 or redis.call('ZCARD', fq) + 1 > allowance
  end
  return mine.n + 1 > share
end

local function admit_one(KEYS, ARGV)
  local n = tonumber(ARGV[1])
  local beside = ARGV[3 * n + 3] == '1'
  local held_back = ARGV[3 * n + 3] == '2'
  local fa = 3 * n + 4  -- the first argument of the fair queue
  local sa = 3 * n + 9  -- the first argument to hand it straight
  if beside and redis.call('EXISTS', KEYS[n + 4]) == 0 then
    -- Its SET was refused (out of memory, or evicted since: Redis judges
    -- memory command by command): this request alone fails, charging
    -- nothing (the gateway answers 503).
    -- (base/errors.py reads the words 'its input was not stored')
    error('ERR its input was not stored (its SET was refused, or it was evicted)', 0)
  end
  -- the reply, filled as it goes: {admitted, queued, handed, then each
  -- limit's count and ms (2i + 2, 2i + 3), then the first without room}
  local reply, charged = {0, 0, 0}, {}
  local admitted = 1
  local refused_by = 0  -- the first limit without room (1-based; 0: none)

  for i = 1, n do
    local key, cost = KEYS[i], tonumber(ARGV[3 * i])
    local amount, window_ms = tonumber(ARGV[3 * i + 1]), tonumber(ARGV[3 * i + 2]) * 1000
    local w = window(key, window_ms)
    charged[i] = w
    reply[2 * i + 2] = w.eleven - w.oldest
    -- until the window is as it was before any charge: the current bucket
    -- leaves the last ten (the x-ratelimit-reset-requests header)
    reply[2 * i + 3] = w.eleven ~= 0 and math.ceil((w.current + 10) * window_ms / 10) - now or -2
    if cost > 0 then
      local fits, wait = room(key, w, cost, amount)
      if not fits then
        admitted = 0
        if refused_by == 0 then refused_by = i end
        reply[2 * i + 3] = wait >= 0 and wait or window_ms
      end
    end
  end

  local queued = #KEYS > n
  local fq, doorbell, state = KEYS[n + 1], KEYS[n + 2], KEYS[n + 3]
  local key_id = ARGV[fa]
  local cost, weight = 0, 1000
  local s
  if queued and admitted == 1 then
    cost, weight = tonumber(ARGV[fa + 1]) or 0, tonumber(ARGV[fa + 2]) or 1000
    s = fair_state(state, fq, key_id)
    if over_share(ARGV, fa, fq, s, key_id, weight) then admitted = 2 end
  end
  -- (its input held back, expecting a refusal: ask for it, charging nothing)
  if held_back and admitted == 1 then admitted = 3 end

  reply[1] = admitted
  if admitted == 1 then
    for i = 1, n do
      local w, cost_i = charged[i], tonumber(ARGV[3 * i])
      w.eleven, w.held, w.dirty = w.eleven + cost_i, w.held + cost_i, true
      reply[2 * i + 2] = reply[2 * i + 2] + cost_i
      if reply[2 * i + 3] < 0 then
        reply[2 * i + 3] = math.ceil((w.current + 10) * w.window_ms / 10) - now
      end
    end
    -- (a key of another type on the way: queued, as without a worker idle)
    local handable, handed = false, false
    local prefix = ARGV[sa + 4] and ARGV[sa + 3]
    if queued and prefix and not no_hand[prefix] then
      handable, handed = pcall(hand_straight, ARGV, sa)
    end
    if handable and handed then
      reply[3] = 1
    elseif queued then
      reply[2] = queue_fairly(fq, doorbell, state, s, key_id, ARGV[2], cost, weight)
      -- (queued: nothing of its model goes straight in this call any more)
      if prefix then no_hand[prefix] = true end
    end
  end
  if beside and admitted ~= 1 then redis.call('DEL', KEYS[n + 4]) end
  reply[2 * n + 4] = refused_by
  return reply
end

-- Where Redis refuses writes (out of memory; a replica), the call is
-- refused whole, as one request's script was: Redis checks for memory only
-- until a script's first write, and a request's first write may be one it
-- does not check (HDEL), which would let every later request in the call
-- write. So the call's first write is a check that changes nothing
-- (SETRANGE of nothing, which creates no key, on a name beside the first
-- key, in its slot, that no script writes), and a replica's refusal ends
-- the call as an error, which drops the connection.
if #KEYS > 0 then
  local check = redis.pcall('SETRANGE', KEYS[1] .. ':write-check', 0, '')
  -- (found in the text, and returned from there on: Redis 6.2 puts the
  -- script's name first, where a client would not read the error's kind)
  if type(check) == 'table' and check.err then
    local at = string.find(check.err, 'OOM ', 1, true)
      or string.find(check.err, 'READONLY ', 1, true)
    if at then return redis.error_reply(string.sub(check.err, at)) end
  end
end

local count = tonumber(ARGV[1])
local replies = {}
local k, a = 0, 1 + 2 * count
for r = 1, count do
  local nk, na = tonumber(ARGV[2 * r]), tonumber(ARGV[2 * r + 1])
  -- (copied in one step each: a table filled one by one grows a few times;
  -- Lua's unpack stops at 8,000 values, a key of some 2,600 limits)
  local keys, args
  if nk < 4000 and na < 4000 then
    keys, args = {unpack(KEYS, k + 1, k + nk)}, {unpack(ARGV, a + 1, a + na)}
  else
    keys, args = {}, {}
    for j = 1, nk do keys[j] = KEYS[k + j] end
    for j = 1, na do args[j] = ARGV[a + j] end
  end
  k, a = k + nk, a + na
  local ok, reply = pcall(admit_one, keys, args)
  if ok then
    replies[r] = reply
  else
    -- (redis.call raises a table; Lua itself, a string)
    replies[r] = type(reply) == 'table' and tostring(reply.err) or tostring(reply)
  end
end
for key, w in pairs(windows) do
  if w.dirty then write_window(key, w) end
end
for state, s in pairs(states) do write_state(state, s) end
return replies
