-- take_dispatch: a dispatcher holding an idle worker's credit forms a batch
-- at the moment that worker can run it; the batch goes onto that worker's
-- hand-off list (it, and no other, runs it), paid for by the credit. It
-- takes nothing if the credit is no longer its own (it stalled past its
-- heartbeat and the reaper returned the credit: a batch now would run beside
-- the one another dispatcher forms with it), or if the worker's heartbeat is
-- gone (a batch for it would wait for no one: the credit is dropped). If
-- nothing waits at all, the credit goes back onto `ready` (offered): there a
-- gateway hands the next request straight to its worker (hand_straight.lua)
-- and the dispatcher waits for the doorbell, holding nothing.
-- KEYS[1..6] as every take (take_pop.lua)  KEYS[7] credits:{dispatcher}
--   KEYS[8] the credit's worker's heartbeat  KEYS[9] its batches:{worker}
--   then the tiers' keys
-- ARGV[1..5] as every take  ARGV[6] '1': return the envelopes (for tracing)
-- ARGV[7] n  ARGV[8] interval_ms  ARGV[9] headroom (-1: no job)
-- ARGV[10] quiet_ms  ARGV[11..10+T] minimum slots per tier
-- Returns take_reply (take_form.lua); wait_ms > 0: come back after that long.
local t = new_take(KEYS, ARGV, 3)
local own, heartbeat, handoff = KEYS[7], KEYS[8], KEYS[9]
if redis.call('LPOS', own, t.credit) == false then return take_reply(nil, {lost = true}) end
if redis.call('EXISTS', heartbeat) == 0 then return take_reply(nil, {gone = true}) end
-- (the hand-off list is written after envelopes leave their queues, and a
-- script's writes are not undone: a key of another type there, the credit
-- is dropped as a gone worker's, before anything is taken)
local kind = redis.call('TYPE', handoff)['ok']
if kind ~= 'list' and kind ~= 'none' then return take_reply(nil, {gone = true}) end
t.n, t.interval = math.floor(tonumber(ARGV[7])), tonumber(ARGV[8])
t.headroom, t.quiet_ms = tonumber(ARGV[9]), tonumber(ARGV[10])
t.min_slots = {}
for i = 1, t.ntiers do t.min_slots[i] = math.floor(tonumber(ARGV[10 + i]) or 0) end
local wait = paced_ms(t)
if wait > 0 then return take_reply(nil, {wait = wait}) end
local batch = formed(t)
local offered = false
if batch then
  redis.call('LPUSH', handoff, batch)
  redis.call('LREM', own, 1, t.credit)
elseif t.none_queued or not work_waits(t) then
  redis.call('LREM', own, 1, t.credit)
  offer_credit(t)
  offered = true
end
return take_reply(t, {envelopes = ARGV[6] == '1', offered = offered})
