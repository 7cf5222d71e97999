-- settle: what reservations did not use, given back (give_back.lua), from
-- a gateway's answered requests, gathered (queue/settlements.py).
-- KEYS the windows  ARGV[3i-2] the bucket charged in window i  ARGV[3i-1]
-- what goes back to it  ARGV[3i] what was reserved (a budget's in flight).
for i = 1, #KEYS do
  give_back(KEYS[i], ARGV[3 * i - 2], tonumber(ARGV[3 * i - 1]) or 0, tonumber(ARGV[3 * i]) or 0)
end
return 1
