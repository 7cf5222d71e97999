-- settle: what reservations did not use, given back (give_back.lua), from
-- a gateway's answered requests, gathered (queue/settlements.py).
-- KEYS the windows  ARGV[2i-1] the bucket charged in window i  ARGV[2i] what
-- goes back to it.
for i = 1, #KEYS do
  give_back(KEYS[i], ARGV[2 * i - 1], tonumber(ARGV[2 * i]) or 0)
end
return 1
