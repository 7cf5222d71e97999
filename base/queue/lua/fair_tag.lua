-- fair_tag: a request's place in its tier's fair queue (start-time fair
-- queuing; take_pop.lua takes in tag order). Its start tag is the later of
-- the tier's virtual time and its key's last finish tag; its finish tag is
-- the start plus its cost over its key's weight. The tier's fair state (a
-- hash: 'v' virtual time, 'w' the weights of the keys waiting; per key 'f:'
-- finish tag, 'n:' requests waiting, 'w:' the weight it waits with) is read
-- once a call per key and written once, as the call ends. A key's share: it
-- may have waiting at most its weight's share of the tier's allowance.
-- Needs numbers.lua. Put before admit.lua (scripts.py).
local function fair_state(states, state, fq, key_id)
  -- a tier's fair state as the call left it (in `states`), with `key_id`'s
  -- fields read (a state of another type is not a script's: it starts over;
  -- one whose queue is gone, deleted or evicted, is stale: it goes)
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

local function over_share(allowance, recent, fq, s, key_id, weight)
  -- whether the key already holds its weight's share of the tier's
  -- allowance (0: no check), among the keys waiting or the weights the
  -- gateway admitted lately if more (the weight it waits with: the policy
  -- may have changed it since); a share under one request: one while the
  -- tier has room
  if allowance <= 0 then return false end
  local mine = s.keys[key_id]
  local others = s.w - (mine.n > 0 and (mine.w or weight) or 0)
  local sharing = math.max(math.max(others, 0) + weight, recent)
  local share = math.floor(allowance * weight / sharing)
  if share < 1 then return mine.n >= 1 or redis.call('ZCARD', fq) + 1 > allowance end
  return mine.n + 1 > share
end

local function queue_fairly(fq, s, key_id, envelope, cost, weight)
  -- onto the tier's fair queue at its start tag; its key's state after it
  -- (in the call's copy)
  local mine = s.keys[key_id]
  local start = math.max(s.v, mine.f)
  local added = redis.pcall('ZADD', fq, start, envelope)
  if type(added) ~= 'number' then
    -- a key of another type (planted) is no tier's queue: it goes; any
    -- other error is raised, never a reason to delete a queue (out of
    -- memory is refused whole before this, admit.lua's write check)
    if not string.find(tostring(added.err), 'WRONGTYPE', 1, true) then error(added) end
    redis.call('DEL', fq)
    redis.call('ZADD', fq, start, envelope)
  end
  mine.f = start + cost * 1000 / math.max(weight, 1)
  if mine.n <= 0 then
    mine.w = weight
    s.w = s.w + weight
    s.dirty['w:' .. key_id] = weight
    s.dirty['w'] = s.w
  end
  mine.n = mine.n + 1
  s.queued[key_id] = mine
end
