-- ack_batch: a worker's batch has been answered (its replies are published in
-- the same pipeline, just before). Drop it from the worker's processing list
-- and, unless the worker is leaving, offer the worker's credit again; at most
-- one credit per worker is ever on the ready list.
-- KEYS[1] processing:{worker}  KEYS[2] ready
-- ARGV[1] worker id  ARGV[2] '1' to offer a credit, '0' not to
redis.call('DEL', KEYS[1])
redis.call('LREM', KEYS[2], 0, ARGV[1])
if ARGV[2] == '1' then redis.call('LPUSH', KEYS[2], ARGV[1]) end
return 1
