-- reaper_lock: take, extend or release the fleet-wide reaper lock in one
-- step, checked against the owner's token, so a lock that expired and was
-- taken by another dispatcher is never extended or released by the old one.
-- KEYS[1] reaper-lock
-- ARGV[1] owner token  ARGV[2] 'hold' or 'release'  ARGV[3] TTL (ms) for 'hold'
-- Returns 1 if the owner holds the lock (hold) or released it (release), else 0.
local holder = redis.call('GET', KEYS[1])
if ARGV[2] == 'release' then
  if holder == ARGV[1] then redis.call('DEL', KEYS[1]); return 1 end
  return 0
end
if holder == false then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', tonumber(ARGV[3]))
  return 1
end
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]))
  return 1
end
return 0
