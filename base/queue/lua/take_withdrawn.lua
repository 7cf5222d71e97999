-- take_withdrawn: as the call that take_join.lua withdrew a worker's credit
-- for ends, the credit comes back once (the mark goes first), to a live
-- worker, and only if it is still out of everyone's hands: not back on
-- `ready` (offered again), not spent on a batch on its hand-off list (the
-- worker offers it when that one has run). It pays for a batch formed now,
-- onto the hand-off list, or goes onto `ready`. (A batch pulled from the
-- shared list meanwhile took the mark away, pull_waiting.lua.)
-- KEYS[1..6] as every take (take_pop.lua)  KEYS[7] the batching rule
--   KEYS[8] batches:{worker}  KEYS[9] the mark of its withdrawn credit
--   then the tiers' keys
-- ARGV[1..5] as every take
-- Returns take_reply (take_form.lua); credit lost: its worker has gone.
local t = new_take(KEYS, ARGV, 3)
local rule, handoff, mark = KEYS[7], KEYS[8], KEYS[9]
if redis.call('DEL', mark) == 0 then return take_reply(nil, {}) end
if redis.call('EXISTS', t.prefix .. 'hb:worker:' .. t.credit) == 0 then
  return take_reply(nil, {lost = true})
end
-- (a hand-off list of another type: written after envelopes leave their
-- queues, so nothing is taken for it; the credit goes back)
local kind = redis.call('TYPE', handoff)['ok']
if kind ~= 'list' and kind ~= 'none' then
  offer_credit(t)
  return take_reply(nil, {})
end
if redis.call('LPOS', t.ready, t.credit) or redis.call('LLEN', handoff) > 0 then
  return take_reply(nil, {})
end
local _, taken = formed_onto(t, rule, handoff)
return take_reply(taken, {})
