-- hand_straight: a request admitted while nothing at all is queued, an idle
-- worker's credit is on `ready` (not held by a dispatcher) and pacing would
-- not hold it back, is formed into a batch of its own and handed off with
-- that credit, as a dispatcher's take would do the moment the doorbell woke
-- it (the same frame, rule and counts), one hop and one round trip sooner.
-- Anything queued ahead of it (of a higher tier, or jobs a batch would take
-- along), no published batching rule, or no live idle worker: it is queued.
-- The keys it reads are named from the model's prefix (Keys in keys.py).
-- Needs rule.lua, idle_worker.lua, frame.lua. Put before admit.lua.
local function pacing_interval(rule_key, ntiers)
  -- the published rule's pacing interval (ms; 0 when batches are of one,
  -- as a take never holds a full batch); nil if no rule a take would read
  local batch_size, interval = published_rule(rule_key, ntiers)
  if batch_size == nil then return nil end
  return batch_size > 1 and interval or 0
end

local function nothing_queued(prefix, tiers)
  -- whether no tier queue, job queue or fair queue of the model holds
  -- anything (one EXISTS of them all), and how many tiers there are
  local names = {}
  for tier in string.gmatch(tiers, '%S+') do
    for _, kind in ipairs({'queue:', 'jobs:', 'fq:', 'jfq:'}) do
      names[#names + 1] = prefix .. kind .. tier
    end
  end
  return redis.call('EXISTS', unpack(names)) == 0, #names / 4
end

local function hand_straight(h)
  -- `h`: batch_id, former, formed_ms, prefix, tiers (names, highest first),
  -- envelope. True if handed to an idle worker; false if it must be queued
  -- (then, if `h.no_worker`, no request of its model in the call looks again:
  -- nothing in a call puts a credit on `ready`).
  local prefix = h.prefix
  local ready = prefix .. 'ready'
  if redis.call('LLEN', ready) == 0 then h.no_worker = true return false end
  local empty, ntiers = nothing_queued(prefix, h.tiers)
  if not empty then return false end
  local interval = pacing_interval(prefix .. 'batch-rule', ntiers)
  if interval == nil then return false end
  local at = tonumber(h.formed_ms)
  local last_key, stats = prefix .. 'last-dispatch', prefix .. 'stats'
  local last = math.min(tonumber(redis.pcall('GET', last_key)) or 0, at)
  if interval > 0 and last + interval > at then return false end
  -- Nothing after the credit is spent may fail (the envelope would be
  -- queued as well): the keys it writes are checked first.
  local stats_kind = redis.call('TYPE', stats)['ok']
  if stats_kind ~= 'hash' and stats_kind ~= 'none' then return false end
  local _, handoff = idle_worker(ready, prefix .. 'hb:worker:', prefix .. 'batches:')
  if not handoff then return false end
  redis.call('LPUSH', handoff, framed(h.batch_id, h.former, h.formed_ms, {h.envelope}))
  -- (a count that is not an integer stays wrong, as in a take; the batch goes)
  redis.pcall('HINCRBY', stats, 'batches_formed', 1)
  redis.pcall('HINCRBY', stats, 'requests_batched', 1)
  redis.call('SET', last_key, h.formed_ms, 'PX', 60000)  -- (SET replaces any type)
  return true
end
