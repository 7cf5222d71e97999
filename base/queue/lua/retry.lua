-- retry: move a dead worker's newest batch out of its processing list (so
-- that of two, the older goes back last, nearest the front), either back
-- to the batches list (as a new encoding with attempt + 1) or, past the retry
-- budget, to the capped dead-letter list; and withdraw the dead worker's
-- credits. One step, and only if the batch is still the one the reaper read
-- (so a batch is never moved twice).
-- KEYS[1] processing:{worker}  KEYS[2] batches  KEYS[3] dead-letter
-- KEYS[4] ready  KEYS[5] stats
-- ARGV[1] the batch as read  ARGV[2] the batch to requeue ('' to dead-letter)
-- ARGV[3] worker id  ARGV[4] dead-letter cap
-- Returns 1 if moved, 0 if the batch had already moved.
redis.call('LREM', KEYS[4], 0, ARGV[3])
if redis.call('LINDEX', KEYS[1], 0) ~= ARGV[1] then return 0 end
redis.call('LPOP', KEYS[1])
if ARGV[2] ~= '' then
  redis.call('RPUSH', KEYS[2], ARGV[2])
  redis.call('HINCRBY', KEYS[5], 'batches_retried', 1)
else
  redis.call('LPUSH', KEYS[3], ARGV[1])
  redis.call('LTRIM', KEYS[3], 0, tonumber(ARGV[4]) - 1)
  redis.call('HINCRBY', KEYS[5], 'batches_dead_lettered', 1)
end
return 1
