-- ensure_credit: an idle worker makes sure its credit is on offer (a Redis
-- that restarted lost it). Does nothing if the credit is on `ready`, held by
-- a dispatcher, withdrawn while its backend runs another shard's batch
-- (take_join.lua), or already spent on a batch waiting for it in
-- `batches:{worker}`; so a worker never has two credits out.
-- KEYS[1] ready  KEYS[2] batches:{worker}  KEYS[3] withdrawn:{worker}
-- KEYS[4..] credits:{dispatcher}, every dispatcher
-- ARGV[1] worker id
-- Returns 1 if a credit was offered, 0 if one was already out.
if redis.call('LLEN', KEYS[2]) > 0 then return 0 end
if redis.call('LPOS', KEYS[1], ARGV[1]) then return 0 end
if redis.call('EXISTS', KEYS[3]) == 1 then return 0 end
for i = 4, #KEYS do
  if redis.call('LPOS', KEYS[i], ARGV[1]) then return 0 end
end
redis.call('LPUSH', KEYS[1], ARGV[1])
return 1
