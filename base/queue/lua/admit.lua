-- admit: the requests a gateway gathered in one moment (queue/admits.py),
-- each admitted in turn as if it came alone (admit_request.lua), with one
-- reading of Redis's clock, so every gateway judges on one clock. A request
-- that fails (a step's error) fails alone: its reply is the error's text.
-- Within a call each window, fair state and doorbell is read once and
-- written once, as the call ends: the requests after the first read what the
-- ones before left, from the call's own copy. No other command runs during
-- a script, so what each request sees, and what Redis holds after, is what
-- one call a request would see and leave, at a few commands a key.
-- ARGV[1] how many requests (m); ARGV[2i], ARGV[2i+1] request i's number of
-- keys and of arguments; then each request's keys in KEYS and its
-- arguments in ARGV (after the first 2m + 1), one request after another.
-- Returns one reply a request (admit_request.lua), or its error's text.
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local call = {windows = windows_at(now), states = {}, rung = {}, no_hand = {}}

function call.ring(doorbell)
  -- once a call, kept at one ring (a dispatcher that waits takes it at once;
  -- a key of another type, planted, is no doorbell: it goes)
  if call.rung[doorbell] then return end
  local rings = redis.pcall('LLEN', doorbell)
  if type(rings) ~= 'number' then redis.call('DEL', doorbell) rings = 0 end
  if rings == 0 then redis.call('LPUSH', doorbell, '1') end
  call.rung[doorbell] = true
end

-- Where Redis refuses writes (out of memory; a replica), the call is
-- refused whole: Redis checks for memory only until a script's first write,
-- and a request's first write may be one it does not check (HDEL), which
-- would let every later request write. So the call's first write is one
-- that changes nothing (SETRANGE of nothing, which creates no key, on a name
-- beside the first key, in its slot, that no script writes).
if #KEYS > 0 then
  local check = redis.pcall('SETRANGE', KEYS[1] .. ':write-check', 0, '')
  -- (found in the text, and returned from there on: Redis 6.2 puts the
  -- script's name first, where a client would not read the error's kind)
  if type(check) == 'table' and check.err then
    local at = string.find(check.err, 'OOM ', 1, true)
      or string.find(check.err, 'READONLY ', 1, true)
    if at then return redis.error_reply(string.sub(check.err, at)) end
  end
end

local requests = tonumber(ARGV[1])
local replies = {}
local k, a = 0, 1 + 2 * requests
for r = 1, requests do
  local nk, na = tonumber(ARGV[2 * r]), tonumber(ARGV[2 * r + 1])
  -- (copied in one step each: a table filled one by one grows a few times;
  -- Lua's unpack stops at 8,000 values, a key of some 2,600 limits)
  local keys, args
  if nk < 4000 and na < 4000 then
    keys, args = {unpack(KEYS, k + 1, k + nk)}, {unpack(ARGV, a + 1, a + na)}
  else
    keys, args = {}, {}
    for j = 1, nk do keys[j] = KEYS[k + j] end
    for j = 1, na do args[j] = ARGV[a + j] end
  end
  k, a = k + nk, a + na
  local ok, reply = pcall(admit_request, call, keys, args)
  -- (redis.call raises a table; Lua itself, a string)
  replies[r] = ok and reply or (type(reply) == 'table' and tostring(reply.err) or tostring(reply))
end
call.windows.write_all()
for state, s in pairs(call.states) do write_state(state, s) end
return replies
