-- ack_batch: a leaving worker's batch has been answered (its replies are
-- published, and its jobs' results stored, in the same transaction, just
-- before). Take it off the worker's processing list, and take back the
-- worker's credit if one is on offer. (A worker that stays has already
-- formed its next batch, or offered its credit, with take_worker.lua:
-- its answer only takes the batch off processing.)
-- KEYS[1] processing:{worker}  KEYS[2] ready
-- ARGV[1] worker id  ARGV[2] the batch (as pulled)
redis.call('LREM', KEYS[1], 0, ARGV[2])
redis.call('LREM', KEYS[2], 0, ARGV[1])
return false
