-- ack_batch: a worker's batch has been answered (its replies are published,
-- and its jobs' results stored, in the same transaction, just before). Drop
-- it from the worker's processing list and, unless the worker is leaving,
-- offer the worker's credit again; at most one credit per worker is ever on
-- the ready list. With jobs waiting, ring the doorbell: a dispatcher waiting
-- for headroom to run them may have it now.
-- KEYS[1] processing:{worker}  KEYS[2] ready  KEYS[3] doorbell  KEYS[4..] jobs:{tier}
-- ARGV[1] worker id  ARGV[2] '1' to offer a credit, '0' not to
redis.call('DEL', KEYS[1])
redis.call('LREM', KEYS[2], 0, ARGV[1])
if ARGV[2] == '1' then
  redis.call('LPUSH', KEYS[2], ARGV[1])
  for i = 4, #KEYS do
    if redis.call('LLEN', KEYS[i]) > 0 then
      redis.call('LPUSH', KEYS[3], '1')
      redis.call('LTRIM', KEYS[3], 0, 0)
      break
    end
  end
end
return 1
