-- requeue: return a dispatcher's inflight envelopes to the FRONT of their
-- tier queues (they are older than anything queued behind them, so they are
-- taken next, in their original order), and the credits it held to the
-- ready list, in one step. Used on a dispatcher's own shutdown and by the
-- reaper for a dead dispatcher.
-- KEYS[1] inflight:{dispatcher}  KEYS[2] credits:{dispatcher}  KEYS[3] ready
-- KEYS[4] doorbell  KEYS[5] stats  KEYS[6] jobs-queued
-- KEYS[6+i] the queue ARGV[1+i] names ('free' for queue:free, 'job:free' for jobs:free)
-- ARGV[1] the job record key prefix  ARGV[1+i] queue names, same order as the queues
-- A job goes back to its job queue, its record to 'queued' and its key's
-- count up again.
-- Returns {envelopes requeued, credits returned}
local queue_of = {}
for i = 2, #ARGV do queue_of[ARGV[i]] = KEYS[5 + i] end
local fallback = KEYS[#KEYS]

local envs = redis.call('LRANGE', KEYS[1], 0, -1)
for i = #envs, 1, -1 do
  local ok, env = pcall(cjson.decode, envs[i])
  local queue = fallback
  if ok and type(env) == 'table' then
    local name = (env.job and 'job:' or '') .. tostring(env.tier)
    if queue_of[name] then queue = queue_of[name] end
    if env.job and type(env.id) == 'string' and type(env.key_id) == 'string' then
      redis.call('HINCRBY', KEYS[6], env.key_id, 1)
      if redis.call('TYPE', ARGV[1] .. env.id)['ok'] == 'hash' then
        redis.call('HSET', ARGV[1] .. env.id, 'status', 'queued')
      end
    end
  end
  redis.call('RPUSH', queue, envs[i])
end
redis.call('DEL', KEYS[1])

local credits = redis.call('LRANGE', KEYS[2], 0, -1)
for _, credit in ipairs(credits) do
  redis.call('LREM', KEYS[3], 0, credit)
  redis.call('RPUSH', KEYS[3], credit)
end
redis.call('DEL', KEYS[2])

if #envs > 0 then
  redis.call('HINCRBY', KEYS[5], 'requeued', #envs)
  redis.call('LPUSH', KEYS[4], '1')
  redis.call('LTRIM', KEYS[4], 0, 0)
end
return {#envs, #credits}
