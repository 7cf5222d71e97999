-- beats: a role's registered processes and each one's heartbeat, read one
-- way by every script that looks at the fleet (fleet, heartbeats, reap).
-- A members key of another type (planted) is no set: it goes. A heartbeat
-- of another type reads as expired, as MGET would have it, instead of
-- failing the whole read (Redis contents are not trusted).
local function beats_of(members, prefix)
  local ids = redis.pcall('SMEMBERS', members)
  if ids.err then
    -- (a key of another type, planted, is no members set: it goes; any
    -- other error is the call's)
    if not string.find(ids.err, 'WRONGTYPE', 1, true) then error(ids) end
    redis.call('DEL', members)
    ids = {}
  end
  table.sort(ids)
  local beats = {}
  for i, id in ipairs(ids) do
    local beat = redis.pcall('GET', prefix .. id)
    if type(beat) ~= 'string' then beat = false end
    beats[i] = beat
  end
  return ids, beats
end
-- Each role's ids and heartbeats, one role after another ({ids, beats,
-- ids, beats, ...}): the members keys from KEYS[first_key], each role's
-- heartbeat key prefix from ARGV[first_arg].
local function roles_beats(first_key, first_arg)
  local out = {}
  for i = first_key, #KEYS do
    local ids, beats = beats_of(KEYS[i], ARGV[first_arg + i - first_key])
    out[#out + 1] = ids
    out[#out + 1] = beats
  end
  return out
end
