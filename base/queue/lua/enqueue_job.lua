-- enqueue_job: accept an asynchronous job, in one step: its record (owner,
-- status 'queued', when its result may be dropped), its envelope in its
-- tier's job fair queue (fair_tag.lua: in its key's fair order, as a
-- tier's requests wait), the owner's queued count, and the doorbell.
-- Refused, with nothing changed, if the owner already has max_queued jobs
-- queued.
-- KEYS[1] jfq:{tier}  KEYS[2] doorbell  KEYS[3] job:{id}  KEYS[4] jobs-queued
--   KEYS[5] jfair:{tier}
-- ARGV[1] envelope (JSON)  ARGV[2] key id  ARGV[3] max queued per key
-- ARGV[4] tier  ARGV[5] created (epoch ms)  ARGV[6] deadline (epoch ms)
-- ARGV[7] result ttl (ms)  ARGV[8] its cost  ARGV[9] its key's weight
-- (thousandths)  ARGV[10] what it reserved of its key's token limits and
-- budgets ('key bucket amount unit' each: give_back.lua's settle_job; ''
-- for none)  ARGV[11] its input's bound in tokens  ARGV[12] its model (a
-- gateway that reads its result learns what it cost: gateway/jobs.py)
-- Returns the job queue's length, or -1 if refused.
local queued = tonumber(redis.call('HGET', KEYS[4], ARGV[2]) or '0')
if queued >= tonumber(ARGV[3]) then return -1 end
local keep_ms = tonumber(ARGV[6]) - tonumber(ARGV[5]) + tonumber(ARGV[7])
redis.call('HSET', KEYS[3], 'key_id', ARGV[2], 'tier', ARGV[4], 'status', 'queued',
  'created_ms', ARGV[5], 'deadline_ms', ARGV[6], 'result_ttl_ms', ARGV[7])
if ARGV[10] ~= '' then
  redis.call('HSET', KEYS[3], 'reserved', ARGV[10], 'input_bound', ARGV[11], 'model', ARGV[12])
end
redis.call('PEXPIRE', KEYS[3], keep_ms)
redis.call('HINCRBY', KEYS[4], ARGV[2], 1)
local states = {}
local s = fair_state(states, KEYS[5], KEYS[1], ARGV[2])
queue_fairly(KEYS[1], s, ARGV[2], ARGV[1], tonumber(ARGV[8]) or 1, tonumber(ARGV[9]) or 1000)
write_state(KEYS[5], s)
redis.call('LPUSH', KEYS[2], '1')
redis.call('LTRIM', KEYS[2], 0, 0)
return redis.call('ZCARD', KEYS[1])
