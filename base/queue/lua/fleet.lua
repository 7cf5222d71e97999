-- fleet: what admission reads every few tens of ms, in one step: the
-- registered workers and gateways, each one's heartbeat (false once it
-- expired, or if it is not a string), and the depth of each tier (its
-- queue list and its fair queue).
-- KEYS[1] members:worker  KEYS[2] members:gateway
-- KEYS[3..2+T] queue:{tier}  KEYS[3+T..2+2T] fq:{tier}
-- ARGV[1] the workers' heartbeat key prefix (the key is the prefix and the
-- id)  ARGV[2] the gateways'
-- Returns {worker ids (sorted), their heartbeats, depths, gateway ids, theirs}
local ids, beats = beats_of(KEYS[1], ARGV[1])
local gateway_ids, gateway_beats = beats_of(KEYS[2], ARGV[2])
local ntiers = (#KEYS - 2) / 2
local function size(command, key)
  -- (a key of another type, planted, holds nothing of a tier's: 0, so one
  -- key does not blind every gateway's view; take_*.lua and admit.lua drop it)
  local n = redis.pcall(command, key)
  return type(n) == 'number' and n or 0
end
local depths = {}
for i = 1, ntiers do
  depths[i] = size('LLEN', KEYS[2 + i]) + size('ZCARD', KEYS[2 + ntiers + i])
end
return {ids, beats, depths, gateway_ids, gateway_beats}
