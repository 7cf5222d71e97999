-- heartbeats: each role's registered processes and each one's heartbeat
-- (false once it expired, or if it is not a string), in one step, whatever
-- the fleet's size (an operator's status, a worker starting among its peers).
-- KEYS[i] members:{role}
-- ARGV[i] that role's heartbeat key prefix (the key is the prefix and the id)
-- Returns {ids (sorted), their heartbeats} for each role in turn.
return roles_beats(1, 1)
