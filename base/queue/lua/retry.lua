-- retry: move a dead worker's newest batch out of its processing list (so
-- that of two, the older goes back last, nearest the front), either back
-- to run again (as a new encoding with attempt + 1) or, past the retry
-- budget, to the capped dead-letter list; and withdraw the dead worker's
-- credits. One step, and only if the batch is still the one the reaper read
-- (so a batch is never moved twice). A batch to run again goes to an idle
-- live worker, with its credit, as a dispatcher hands one off (at the
-- front of its hand-off list: it has waited already); with none idle, to
-- the shared batches list, where a worker's next take finds it first.
-- KEYS[1] processing:{worker}  KEYS[2] batches  KEYS[3] dead-letter
-- KEYS[4] ready  KEYS[5] stats
-- ARGV[1] the batch as read  ARGV[2] the batch to requeue ('' to dead-letter)
-- ARGV[3] worker id  ARGV[4] dead-letter cap
-- ARGV[5] the worker heartbeat key prefix  ARGV[6] the hand-off list prefix
-- Returns 1 if moved, 0 if the batch had already moved.
redis.call('LREM', KEYS[4], 0, ARGV[3])
if redis.call('LINDEX', KEYS[1], 0) ~= ARGV[1] then return 0 end
redis.call('LPOP', KEYS[1])
if ARGV[2] ~= '' then
  local _, handoff = idle_worker(KEYS[4], ARGV[5], ARGV[6])  -- idle_worker.lua
  redis.call('RPUSH', handoff or KEYS[2], ARGV[2])
  redis.call('HINCRBY', KEYS[5], 'batches_retried', 1)
else
  redis.call('LPUSH', KEYS[3], ARGV[1])
  redis.call('LTRIM', KEYS[3], 0, tonumber(ARGV[4]) - 1)
  redis.call('HINCRBY', KEYS[5], 'batches_dead_lettered', 1)
end
return 1
