-- settle: what a request's reservation of a hard bound (tokens) did not use,
-- given back to the bucket it was charged in (window.lua), so no window ever
-- counts less than the request used; a bucket gone (out of every window)
-- has nothing left to give back to. At most what the bucket holds. What
-- goes back is negative for a request that used more than it reserved: the
-- excess is charged to the same bucket.
-- KEYS the windows  ARGV[2i-1] the bucket charged in window i  ARGV[2i] what
-- goes back to it. Needs numbers.lua.
for i = 1, #KEYS do
  local bucket, back = ARGV[2 * i - 1], tonumber(ARGV[2 * i]) or 0
  local raw = redis.pcall('HMGET', KEYS[i], bucket, 's')
  if back ~= 0 and type(raw) == 'table' and not raw.err and raw[1] and raw[2] then
    local held, sum = count(raw[1]), count(raw[2])
    if held ~= nil and sum ~= nil then
      -- (a give-back never adds: a bucket or window left below it by
      -- refunds gives back only down to nothing)
      local x = back > 0 and math.max(math.min(back, held, sum), 0) or back
      if x ~= 0 then redis.call('HSET', KEYS[i], bucket, held - x, 's', sum - x) end
    end
  end
end
return 1
