-- charge_at: one request's limits checked and charged as admit_request.lua
-- does it, at the time ARGV[1] says (epoch ms) instead of Redis's clock, so
-- that tests/test_windows.py can step time for the windows' reference model.
-- KEYS the windows  ARGV[1] now  ARGV[4i-2..4i+1] limit i's cost, amount,
-- most in eleven buckets and window (s). Returns admit_request.lua's reply,
-- less what queueing adds.
local windows = windows_at(tonumber(ARGV[1]))
-- (the request as admit_request.lua's parsed reads one: limit i's cost,
-- amount, most and window at ARGV[4i-1..4i+2])
local r = {n = #KEYS, keys = KEYS, args = {#KEYS, '', unpack(ARGV, 2)}}
local reply = {0, 0, 0}
local charged, room_all, refused_by = checked_limits(windows, r, reply)
if room_all then
  reply[1] = 1
  charge_limits(windows, r, charged, reply)
end
reply[2 * r.n + 4] = refused_by
windows.write_all()
return reply
