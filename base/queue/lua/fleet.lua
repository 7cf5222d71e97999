-- fleet: what admission reads every few tens of ms, in one step: the
-- registered workers, each one's heartbeat (false once it expired, or if it
-- is not a string), and the
-- depth of each tier queue.
-- KEYS[1] members:worker  KEYS[2..] queue:{tier}
-- ARGV[1] the workers' heartbeat key prefix (the key is the prefix and the id)
-- Returns {ids (sorted), heartbeats, depths}
local ids = redis.call('SMEMBERS', KEYS[1])
table.sort(ids)
local beats = {}
for i, id in ipairs(ids) do
  -- pcall: a key of another type (Redis contents are not trusted) reads as
  -- expired, as MGET would have it, instead of failing the whole view.
  local beat = redis.pcall('GET', ARGV[1] .. id)
  if type(beat) ~= 'string' then beat = false end
  beats[i] = beat
end
local depths = {}
for i = 2, #KEYS do
  depths[i - 1] = redis.call('LLEN', KEYS[i])
end
return {ids, beats, depths}
