-- charge_usage: add what each key's requests in a batch cost to this hour's
-- usage (queue/usage.py). Run in the transaction that answers the batch, so
-- it never fails: a hash of another type, or a field HINCRBY cannot add to
-- (planted: Redis contents are not trusted), starts over, and what cannot be
-- counted is let go; the answer goes out whatever happens here.
-- KEYS[1] usage:{hour}
-- ARGV[1] how long it is kept (s)  ARGV[2i], ARGV[2i+1] a field and its amount
local key = KEYS[1]
local kind = redis.call('TYPE', key)['ok']
if kind ~= 'hash' and kind ~= 'none' then redis.call('DEL', key) end
for i = 2, #ARGV, 2 do
  local added = redis.pcall('HINCRBY', key, ARGV[i], ARGV[i + 1])
  if type(added) ~= 'number' then
    redis.call('HDEL', key, ARGV[i])
    redis.pcall('HINCRBY', key, ARGV[i], ARGV[i + 1])
  end
end
redis.call('EXPIRE', key, ARGV[1])
return 1
