-- ack_batch: a worker's batch has been answered (its replies are published,
-- and its jobs' results stored, in the same transaction, just before). Take
-- it off the worker's processing list, and settle the worker's credit, which
-- the worker offered (offer_credit.lua) the moment its backend call returned,
-- so the next batch could form while this one was answered:
--   'none': take it back (the worker is leaving);
--   'next': leave it, and move the next batch waiting on `batches` into
--           processing in the same step (no pull round trip): the worker
--           runs it next. Repeatable: if the reply to this step is lost and
--           the worker runs it again, it gets the same next batch back, and
--           no credit is offered twice.
-- A processing list holds one batch at a time: the next is moved in only
-- once this one is off it.
-- KEYS[1] processing:{worker}  KEYS[2] ready  KEYS[3] batches
-- ARGV[1] worker id  ARGV[2] 'none' or 'next'  ARGV[3] the batch (as pulled)
-- Returns the batch now in processing ('next'), or false.
redis.call('LREM', KEYS[1], 0, ARGV[3])
if ARGV[2] == 'none' then
  redis.call('LREM', KEYS[2], 0, ARGV[1])
  return false
end
if redis.call('LLEN', KEYS[1]) == 0 then
  redis.call('LMOVE', KEYS[3], KEYS[1], 'RIGHT', 'LEFT')
end
return redis.call('LINDEX', KEYS[1], -1)
