-- take_worker: a worker whose backend has just returned forms its next batch
-- straight into its processing list (no credit, no dispatcher, no pull),
-- beside the batch just run, which leaves once its replies are published
-- (while the next one runs; for a small batch, in this step: 'ack'). A batch
-- already waiting is run first: one handed off with its credit while it ran
-- a retried batch, else one the reaper retried. With nothing to take (or
-- pacing says wait, or no dispatcher has published the batching rule), its
-- credit goes onto `ready` instead, for a dispatcher. A step whose token is
-- the last step's was run before (its reply was lost): whatever is in
-- processing beside the batch just run is the answer again, and nothing
-- more is formed or offered.
-- KEYS[1..6] as every take (take_pop.lua)  KEYS[7] processing:{worker}
--   KEYS[8] the batching rule  KEYS[9] batches (the reaper's retried ones)
--   KEYS[10] the worker's last step (its token)  then the tiers' keys
-- ARGV[1..5] as every take (the credit: the worker's id)  ARGV[6] the batch
-- just run (as pulled)  ARGV[7] this step's token  ARGV[8] 'ack': take the
-- batch just run off processing in the same step
-- Returns take_reply (take_form.lua), the batch now in processing in it;
-- credit lost: the batch just run was gone and nothing is in hand, so
-- whether the credit is out is unknown (ensure_credit.lua makes sure).
local t = new_take(KEYS, ARGV, 4)
local own, rule, shared, last_step = KEYS[7], KEYS[8], KEYS[9], KEYS[10]
local ran, token, ack = ARGV[6], ARGV[7], ARGV[8] == 'ack'
-- (a token key of another type is no token: the SET below replaces it)
local repeated = redis.pcall('GET', last_step) == token
-- The batch just run alone there is found by LPOS, without reading it into
-- the script (a string made in a script costs about a nanosecond a byte).
if repeated or redis.call('LLEN', own) ~= 1 or redis.call('LPOS', own, ran) ~= 0 then
  local following = false
  for _, b in ipairs(redis.call('LRANGE', own, 0, 2)) do
    if b ~= ran then following = b break end
  end
  -- Its replies go out in this transaction whatever is found here: a first
  -- run (something else was in processing: left there by a Redis restored
  -- from disk, or planted) still takes it off.
  if ack and not repeated then redis.call('LREM', own, 0, ran) end
  return take_reply(nil, {lost = not (following or repeated), batch = following})
end
-- No TTL: a repeat is known however long it comes after (the reaper and a
-- clean exit delete it).
redis.call('SET', last_step, token)
if ack then redis.call('LREM', own, 0, ran) end
-- (no credit is offered for a batch already waiting: one offered "in its
-- place" would most often be one too many)
local waiting = redis.call('LMOVE', t.prefix .. 'batches:' .. t.credit, own, 'RIGHT', 'LEFT')
  or redis.call('LMOVE', shared, own, 'RIGHT', 'LEFT')
if waiting then return take_reply(nil, {batch = waiting}) end
local batch, taken = formed_onto(t, rule, own)
return take_reply(taken, {batch = batch})
