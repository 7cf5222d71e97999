-- release_lock: let the fleet-wide reaper lock go, if this owner holds it
-- (a dispatcher stopping: another one's reaper takes it at once).
-- KEYS[1] reaper-lock
-- ARGV[1] owner token
-- Returns 1 if it was released, else 0.
if release_lock(KEYS[1], ARGV[1]) then return 1 end
return 0
