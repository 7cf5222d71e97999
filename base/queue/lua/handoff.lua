-- handoff: this dispatcher's inflight envelopes become one batch on the
-- batches list, and the credit that paid for it is spent, in one step.
-- Only if the inflight list still holds exactly the batch's envelopes and the
-- credit is still held: a dispatcher that stalled past its heartbeat has had
-- both returned by the reaper, and must not hand off copies (they would run
-- twice). Records the hand-off time for pacing (see take.lua), unless the
-- batch is of jobs only (they run in spare capacity and pace nothing).
-- KEYS[1] inflight:{dispatcher}  KEYS[2] batches  KEYS[3] credits:{dispatcher}  KEYS[4] stats
-- KEYS[5] last-dispatch
-- ARGV[1] the batch (JSON)  ARGV[2] the credit (worker id)  ARGV[3] batch size  ARGV[4] now (epoch ms)
-- ARGV[5] '1' to record the hand-off for pacing, '0' not to
-- Returns 1 if handed off, 0 if refused (nothing changed).
if redis.call('LLEN', KEYS[1]) ~= tonumber(ARGV[3]) then return 0 end
if redis.call('LPOS', KEYS[3], ARGV[2]) == false then return 0 end
redis.call('LPUSH', KEYS[2], ARGV[1])
redis.call('DEL', KEYS[1])
redis.call('LREM', KEYS[3], 1, ARGV[2])
redis.call('HINCRBY', KEYS[4], 'batches_formed', 1)
redis.call('HINCRBY', KEYS[4], 'requests_batched', tonumber(ARGV[3]))
if ARGV[5] ~= '0' then redis.call('SET', KEYS[5], ARGV[4], 'PX', 60000) end
return 1
