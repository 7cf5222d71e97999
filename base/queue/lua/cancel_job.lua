-- cancel_job: cancel a job of this key that is still queued, in one step:
-- 'take' drops it (the cancelled set), its record says 'cancelled', and it
-- stops counting against its key's bound on queued jobs at once, and what
-- it reserved of its key's token limits and budgets goes back (give_back.lua).
-- KEYS[1] job:{id}  KEYS[2] cancelled (zset: id -> expiry epoch ms)
-- KEYS[3] jobs-queued (hash: key id -> jobs queued)
-- ARGV[1] key id  ARGV[2] job id  ARGV[3] now (epoch ms)
-- Returns the job's status after the call ('cancelled' if it was queued;
-- 'expired' if it was queued past its deadline), or false if this key has
-- no such job. Cancelling a cancelled job again changes nothing.
-- (a record of another type, planted, is no job: an error table owns none)
local owner = redis.pcall('HGET', KEYS[1], 'key_id')
if owner ~= ARGV[1] then return false end
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'queued' then return status end
local deadline = tonumber(redis.call('HGET', KEYS[1], 'deadline_ms') or '')
if deadline == nil or deadline <= tonumber(ARGV[3]) then return 'expired' end
redis.call('ZADD', KEYS[2], deadline, ARGV[2])
redis.call('HSET', KEYS[1], 'status', 'cancelled')
settle_job(KEYS[1], 0, 0)
if redis.call('HINCRBY', KEYS[3], ARGV[1], -1) <= 0 then redis.call('HDEL', KEYS[3], ARGV[1]) end
return 'cancelled'
