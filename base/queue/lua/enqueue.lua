-- enqueue: put one envelope at the back of its tier queue and ring the
-- doorbell, in one step. The doorbell list never holds more than one token:
-- it wakes one waiting dispatcher and never grows.
-- KEYS[1] queue:{tier}   KEYS[2] doorbell
-- ARGV[1] the envelope (JSON)
-- Returns the tier queue's length after the push.
local depth = redis.call('LPUSH', KEYS[1], ARGV[1])
redis.call('LPUSH', KEYS[2], '1')
redis.call('LTRIM', KEYS[2], 0, 0)
return depth
