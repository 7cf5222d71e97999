-- cancel_job: cancel a job of this key that is still queued, in one step:
-- 'take' drops it (the cancelled set) and its record says 'cancelled'.
-- KEYS[1] job:{id}  KEYS[2] cancelled (zset: id -> expiry epoch ms)
-- ARGV[1] key id  ARGV[2] job id
-- Returns the job's status after the call ('cancelled' if it was queued),
-- or false if there is no such job of this key.
local owner = redis.call('HGET', KEYS[1], 'key_id')
if owner ~= ARGV[1] then return false end
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'queued' then return status end
redis.call('ZADD', KEYS[2], tonumber(redis.call('HGET', KEYS[1], 'deadline_ms')), ARGV[2])
redis.call('HSET', KEYS[1], 'status', 'cancelled')
return 'cancelled'
