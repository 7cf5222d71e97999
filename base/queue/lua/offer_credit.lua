-- offer_credit: an idle worker says it can take one batch. Idempotent: the
-- worker's id is on the ready list exactly once afterwards, never twice.
-- KEYS[1] ready
-- ARGV[1] worker id
redis.call('LREM', KEYS[1], 0, ARGV[1])
redis.call('LPUSH', KEYS[1], ARGV[1])
return 1
