-- ack_batch: a worker's batch has been answered (its replies are published,
-- and its jobs' results stored, in the same transaction, just before). Take
-- it off the worker's processing list, and settle the worker's credit:
--   'offer': offer it (as offer_credit.lua: at most one credit per worker on
--            the ready list, and the doorbell rung if jobs wait), only if
--            this step took the batch off processing: run again after its
--            reply was lost, it must not offer a second credit beside the
--            one a dispatcher already holds (a credit Redis really lost, with
--            the batch, is put back by the idle worker's ensure_credit);
--   'none':  take it back (the worker is leaving);
--   'next':  leave it (the worker offered it the moment its backend call
--            returned, so the next batch could form while this one was
--            answered), and move the next batch waiting on `batches` into
--            processing in the same step (no pull round trip): the worker
--            runs it next. Repeatable: if the reply to this step is lost and
--            the worker runs it again, it gets the same next batch back.
-- A processing list holds one batch at a time: the next is moved in only
-- once this one is off it.
-- KEYS[1] processing:{worker}  KEYS[2] ready  KEYS[3] doorbell  KEYS[4] batches
-- KEYS[5..] jobs:{tier}
-- ARGV[1] worker id  ARGV[2] the mode ('offer', 'none' or 'next')  ARGV[3] the batch (as pulled)
-- Returns the batch now in processing ('next'), or false.
local removed = redis.call('LREM', KEYS[1], 0, ARGV[3])
local mode = ARGV[2]
if mode == 'next' then
  if redis.call('LLEN', KEYS[1]) == 0 then
    redis.call('LMOVE', KEYS[4], KEYS[1], 'RIGHT', 'LEFT')
  end
  return redis.call('LINDEX', KEYS[1], -1)
end
if mode == 'none' then
  redis.call('LREM', KEYS[2], 0, ARGV[1])
elseif removed > 0 then
  redis.call('LREM', KEYS[2], 0, ARGV[1])
  redis.call('LPUSH', KEYS[2], ARGV[1])
  for i = 5, #KEYS do
    if redis.call('LLEN', KEYS[i]) > 0 then
      redis.call('LPUSH', KEYS[3], '1')
      redis.call('LTRIM', KEYS[3], 0, 0)
      break
    end
  end
end
return false
