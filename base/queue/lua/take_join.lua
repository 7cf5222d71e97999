-- take_join: a worker that serves several shards through one backend
-- (gpu/gate.py), idle on this shard as the backend starts a call of another
-- shard's batch. Its credit, on `ready` or held by a dispatcher (which finds
-- it gone, as after the reaper took it back), pays for a batch of what waits
-- here, onto its own hand-off list, to run in that same call, which costs
-- the backend nothing more (pacing, which keeps workers free, does not hold
-- it back). With nothing to take, the credit is withdrawn (marked) for the
-- call, until take_withdrawn.lua gives it back. Only a live worker's credit,
-- and only one not spent.
-- KEYS[1..6] as every take (take_pop.lua)  KEYS[7] the batching rule
--   KEYS[8] batches:{worker}  KEYS[9] the mark of its withdrawn credit
--   then the tiers' keys
-- ARGV[1..5] as every take  ARGV[6] how long the mark lasts (ms: a worker
-- that stops before it gives the credit back offers it again after that)
-- ARGV[7] the most the batch may hold (the room left in the call)
-- Returns take_reply (take_form.lua); credit lost: it was neither on
-- `ready` nor held by a dispatcher, and nothing was done.
local t = new_take(KEYS, ARGV, 3)
local rule, handoff, mark = KEYS[7], KEYS[8], KEYS[9]
if redis.call('EXISTS', t.prefix .. 'hb:worker:' .. t.credit) == 0 then
  return take_reply(nil, {lost = true})
end
local found = redis.call('LREM', t.ready, 0, t.credit)
if found == 0 then
  -- (held by a dispatcher: every dispatcher's is named from the prefix)
  local dispatchers = redis.pcall('SMEMBERS', t.prefix .. 'members:dispatcher')
  for _, id in ipairs(dispatchers.err and {} or dispatchers) do
    local held = redis.pcall('LREM', t.prefix .. 'credits:' .. id, 0, t.credit)
    if type(held) == 'number' then found = found + held end
  end
end
if found == 0 then return take_reply(nil, {lost = true}) end
local kind = redis.call('TYPE', handoff)['ok']
if not with_rule(t, rule) or (kind ~= 'list' and kind ~= 'none') then
  redis.call('SET', mark, '1', 'PX', ARGV[6])
  return take_reply(nil, {})
end
t.n, t.interval = math.min(t.n, math.max(math.floor(tonumber(ARGV[7]) or 0), 0)), 0
paced_ms(t)  -- (never paced: it reads the last hand-off, for the jobs)
local batch = formed(t)
if batch then
  redis.call('LPUSH', handoff, batch)
else
  redis.call('SET', mark, '1', 'PX', ARGV[6])
end
return take_reply(t, {})
