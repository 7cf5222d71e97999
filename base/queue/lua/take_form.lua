-- take_form: the batch a take forms, framed (frame.lua), its drops and its
-- counts recorded, and the reply every take entry gives (queue/forming.py's
-- TakeResult reads it by name). Nothing sits between the queues and the
-- batch, so nothing is held by a process that dies. If work is left behind,
-- the doorbell rings again so another dispatcher holding a credit wakes.
-- Pacing: while less than a full batch waits, batches leave no closer
-- together than the rule's interval, fleet-wide, so workers start evenly
-- staggered. A credit not spent goes back onto `ready`, ringing the
-- doorbell if work still waits (a dispatcher holding no credit waits on it).
-- Needs take_pop.lua, frame.lua, rule.lua. Put before the take entries.
local function waiting(t, ...)
  -- whether any of the lists of keys given holds work: one EXISTS of those
  -- not drained in this take
  local names = {}
  for _, group in ipairs({...}) do
    for i = 1, #group do
      if not t.drained[group[i]] then names[#names + 1] = group[i] end
    end
  end
  return #names > 0 and redis.call('EXISTS', unpack(names)) > 0
end

local function ring(t)
  -- the doorbell, kept at one ring (one of another type, planted, goes)
  if wrong_type(redis.pcall('LPUSH', t.doorbell, '1')) then
    redis.call('DEL', t.doorbell)
    redis.call('LPUSH', t.doorbell, '1')
  end
  redis.call('LTRIM', t.doorbell, 0, 0)
end

local function work_waits(t)
  -- whether a tier's queue, fair queue or job queues hold anything
  return waiting(t, t.queues, t.fair_queues, t.job_queues, t.job_fair_queues)
end

local function offer_credit(t)
  -- the worker's credit onto `ready`, once; with work waiting (pacing held
  -- it back, no rule, jobs waiting for headroom), ring the doorbell: a
  -- dispatcher waits on it holding no credit
  -- (a `ready` of another type, planted, goes: takes offer onto it)
  if wrong_type(redis.pcall('LREM', t.ready, 0, t.credit)) then redis.call('DEL', t.ready) end
  redis.call('LPUSH', t.ready, t.credit)
  if not t.none_queued and work_waits(t) then ring(t) end
end

local function paced_ms(t)
  -- > 0: less than a full batch waits and the last hand-off was less than
  -- an interval ago; come back after that long. (The last hand-off, as the
  -- clock of whoever made it said; one ahead of ours holds pacing back by
  -- at most one interval, not by the skew.)
  local last = redis.pcall('GET', t.last_dispatch)  -- (planted: none)
  t.last = math.min(type(last) == 'string' and tonumber(last) or 0, t.now)
  if t.interval <= 0 then return 0 end
  local wait = t.last + t.interval - t.now
  if wait <= 0 then return 0 end
  local queued = 0
  for i = 1, t.ntiers do
    for _, n in ipairs({redis.pcall('ZCARD', t.fair_queues[i]), redis.pcall('LLEN', t.queues[i])}) do
      queued = queued + (type(n) == 'number' and n or 0)
    end
  end
  return (queued > 0 and queued < t.n) and wait or 0
end

local function with_rule(t, rule_key)
  -- the batching rule the dispatchers publish, onto the take; false if none
  local n, interval, headroom, quiet_ms, min_slots = published_rule(rule_key, t.ntiers)
  if n == nil then return false end
  t.n, t.interval, t.headroom, t.quiet_ms, t.min_slots = n, interval, headroom, quiet_ms, min_slots
  return true
end

local function formed(t)
  -- up to t.n envelopes taken, in the order take_pop.lua says; the batch
  -- (false if none), framed; the drops and the hand-off recorded. With no
  -- queue holding anything, one EXISTS and nothing read (t.none_queued)
  if not work_waits(t) then
    t.none_queued = true
    return false
  end
  planted_gone(t)
  t.check_cancelled = redis.call('ZCARD', t.cancelled_set) > 0
  for i = 1, t.ntiers do
    if t.min_slots[i] > 0 then pop_tier(t, i, t.min_slots[i]) end
  end
  for i = 1, t.ntiers do pop_tier(t, i, t.n) end
  if #t.taken < t.n and t.headroom >= 0 and (#t.taken > 0 or t.now - t.last >= t.quiet_ms
      or redis.call('LLEN', t.ready) >= t.headroom) then
    for i = 1, t.ntiers do pop_jobs(t, i, t.n) end
  end
  for _, drop in ipairs({'expired', 'cancelled', 'malformed'}) do
    if t[drop] > 0 then redis.call('HINCRBY', t.stats, drop .. '_dropped', t[drop]) end
  end
  if t.check_cancelled then redis.call('ZREMRANGEBYSCORE', t.cancelled_set, '-inf', t.now) end
  if t.n > 0 and #t.taken >= t.n and waiting(t, t.queues, t.fair_queues) then ring(t) end
  if #t.taken == 0 then return false end
  redis.call('HINCRBY', t.stats, 'batches_formed', 1)
  redis.call('HINCRBY', t.stats, 'requests_batched', #t.taken)
  -- (a batch of jobs only does not count for pacing)
  if t.jobs < #t.taken then redis.call('SET', t.last_dispatch, t.now_text, 'PX', 60000) end
  return framed(t.batch_id, t.former, t.now_text, t.taken)
end

local function formed_onto(t, rule_key, onto)
  -- a worker's credit in hand: a batch formed onto the list `onto`, or the
  -- credit onto `ready` (no rule, pacing holds it back, nothing taken);
  -- the batch (false if none) and the take (nil if nothing was tried)
  if not with_rule(t, rule_key) or paced_ms(t) > 0 then
    offer_credit(t)
    return false, nil
  end
  local batch = formed(t)
  if batch then redis.call('LPUSH', onto, batch) else offer_credit(t) end
  return batch, t
end

local function take_reply(t, r)
  -- {envelopes (if asked), expired, cancelled, malformed, wait_ms, jobs
  -- taken, worker gone, batch size, credit lost, the batch or false, credit
  -- offered}; `t` may be nil (nothing was taken), `r` holds what the entry says
  t = t or {taken = {}, expired = 0, cancelled = 0, malformed = 0, jobs = 0}
  return {r.envelopes and t.taken or {}, t.expired, t.cancelled, t.malformed, r.wait or 0,
    t.jobs, r.gone and 1 or 0, #t.taken, r.lost and 1 or 0, r.batch or false,
    r.offered and 1 or 0}
end
