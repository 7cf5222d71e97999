-- charge_at: one request's limits checked and charged as admit_request.lua
-- does it, at the time ARGV[1] says (epoch ms) instead of Redis's clock, so
-- that tests/test_windows.py can step time for the windows' reference model.
-- KEYS the windows  ARGV[1] now  ARGV[5i-3..5i+1] limit i's cost, amount,
-- most in eleven buckets, window (s) and the least an estimate is cut to.
-- Returns admit_request.lua's reply up to the limit that refused (its
-- clock is the test's; no estimates are cut).
local windows = windows_at(tonumber(ARGV[1]))
-- (the request as admit_request.lua's parsed reads one: limit i's cost,
-- amount, most, window and least at ARGV[5i-2..5i+2])
local r = {n = #KEYS, keys = KEYS, args = {#KEYS, '', unpack(ARGV, 2)}}
local reply = {0, 0, 0}
local charged, costs, asked, room_all, refused_by = checked_limits(windows, r, reply)
if room_all then
  reply[1] = 1
  charge_limits(windows, r, charged, costs, asked, reply)
end
reply[2 * r.n + 4] = refused_by
windows.write_all()
return reply
