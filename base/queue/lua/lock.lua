-- lock: a lock held under its owner's token, so one that expired and was
-- taken by another owner is never extended or released by the old one
-- (the fleet-wide reaper lock: reap, release_lock).
local function hold_lock(key, token, ttl_ms)
  local holder = redis.call('GET', key)
  if holder == false then
    redis.call('SET', key, token, 'PX', ttl_ms)
    return true
  end
  if holder == token then
    redis.call('PEXPIRE', key, ttl_ms)
    return true
  end
  return false
end
local function release_lock(key, token)
  if redis.call('GET', key) ~= token then return false end
  redis.call('DEL', key)
  return true
end
