-- charge_at: one request's limits checked and charged as admit_request.lua
-- does it, at the time ARGV[1] says (epoch ms) instead of Redis's clock, so
-- that tests/test_windows.py can step time for the windows' reference model.
-- KEYS the windows  ARGV[1] now  ARGV[3i-1..3i+1] limit i's cost, amount and
-- window (s). Returns admit_request.lua's reply, less what queueing adds.
local windows = windows_at(tonumber(ARGV[1]))
local limits = {}
for i = 1, #KEYS do
  limits[i] = {key = KEYS[i], cost = tonumber(ARGV[3 * i - 1]), amount = tonumber(ARGV[3 * i]),
    window_ms = tonumber(ARGV[3 * i + 1]) * 1000}
end
local reply = {0, 0, 0}
local charged, room_all, refused_by = checked_limits(windows, limits, reply)
if room_all then
  reply[1] = 1
  charge_limits(windows, limits, charged, reply)
end
reply[2 * #limits + 4] = refused_by
windows.write_all()
return reply
