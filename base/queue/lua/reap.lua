-- reap: the reaper's look, in one step: the fleet-wide lock held (taken,
-- or extended by its owner), and only with it each role's registered
-- processes and heartbeats, as heartbeats.lua reads them. A dispatcher
-- that does not hold the lock reads nothing; the one that does makes one
-- round trip every half second, at rest too.
-- KEYS[1] reaper-lock  KEYS[2..] members:{role}
-- ARGV[1] owner token  ARGV[2] the lock's TTL (ms)
-- ARGV[3..] each role's heartbeat key prefix (the key is the prefix and the id)
-- Returns false without the lock, else {ids (sorted), their heartbeats}
-- for each role in turn (none given: the lock alone).
if not hold_lock(KEYS[1], ARGV[1], tonumber(ARGV[2])) then return false end
return roles_beats(2, 3)
