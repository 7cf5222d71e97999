-- pull_waiting: an idle worker takes a batch waiting on the shared batches
-- list (retried while no worker was idle, or handed back by one that left)
-- into its processing list; no credit paid for it, so the worker's own, if
-- still on `ready`, goes back in the same step (a dispatcher cannot take it
-- in between and hand it a second batch); so does a credit withdrawn while
-- its backend runs another shard's batch (its mark goes: the gate gives
-- nothing back for it, take_withdrawn.lua).
-- KEYS[1] batches  KEYS[2] processing:{worker}  KEYS[3] ready
-- KEYS[4] withdrawn:{worker}
-- ARGV[1] the worker id
-- Returns the batch, or false if none waits.
local batch = redis.call('LMOVE', KEYS[1], KEYS[2], 'RIGHT', 'LEFT')
if batch then
  redis.call('LREM', KEYS[3], 0, ARGV[1])
  redis.call('DEL', KEYS[4])
end
return batch
