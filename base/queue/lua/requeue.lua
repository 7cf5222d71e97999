-- requeue: return a dispatcher's inflight envelopes to the FRONT of their
-- tier queues (they are older than anything queued behind them, so they are
-- taken next, in their original order), and the credits it held to the
-- ready list, in one step. Used on a dispatcher's own shutdown and by the
-- reaper for a dead dispatcher.
-- KEYS[1] inflight:{dispatcher}  KEYS[2] credits:{dispatcher}  KEYS[3] ready
-- KEYS[4] doorbell  KEYS[5] stats  KEYS[5+i] queue of tier ARGV[i]
-- ARGV[i] tier names, same order as the queues
-- Returns {envelopes requeued, credits returned}
local queue_of = {}
for i, tier in ipairs(ARGV) do queue_of[tier] = KEYS[5 + i] end
local fallback = KEYS[#KEYS]

local envs = redis.call('LRANGE', KEYS[1], 0, -1)
for i = #envs, 1, -1 do
  local ok, env = pcall(cjson.decode, envs[i])
  local queue = fallback
  if ok and type(env) == 'table' and queue_of[env.tier] then queue = queue_of[env.tier] end
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
