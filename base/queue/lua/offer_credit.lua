-- offer_credit: an idle worker says it can take one batch. Idempotent: the
-- worker's id is on the ready list exactly once afterwards, never twice.
-- With work waiting (jobs waiting for headroom, requests queued before it
-- came), ring the doorbell: a dispatcher may be waiting on it, holding no
-- credit.
-- KEYS[1] ready  KEYS[2] doorbell  KEYS[3..] the queues: jobs:, queue:, fq:, jfq:
-- ARGV[1] worker id
redis.call('LREM', KEYS[1], 0, ARGV[1])
redis.call('LPUSH', KEYS[1], ARGV[1])
for i = 3, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    redis.call('LPUSH', KEYS[2], '1')
    redis.call('LTRIM', KEYS[2], 0, 0)
    break
  end
end
return 1
