-- take_envelope: one envelope off a queue, taken into the batch or dropped
-- and counted. Dropped: past its deadline (on Redis's clock), cancelled, or
-- unreadable (not JSON, or without a numeric deadline_ms, a string id and
-- gateway, and a string input or, for a long input kept beside the queue, a
-- null input and a string input_key): it never reaches a worker, and its
-- long input is deleted with it, and a reservation its gateway left beside
-- it given back (give_back.lua). A job taken is marked 'running', one dropped
-- 'expired' (and all it reserved given back); either way its key's queued
-- count goes down. `t` is the take
-- (take_pop.lua: new_take). Put before take_pop.lua (scripts.py).
local function left_queue(t, env, status)
  -- a job leaving its queue: its key's count, and its record's status (a
  -- job cancelled while queued was counted out, and settled, then)
  if env.job ~= true then return end
  local record = t.job_prefix .. env.id
  -- (a record is a hash; a key planted under its name is left alone)
  local is_record = redis.call('TYPE', record)['ok'] == 'hash'
  if is_record and redis.call('HGET', record, 'status') == 'cancelled' then return end
  if type(env.key_id) == 'string' then
    if redis.call('HINCRBY', t.jobs_queued, env.key_id, -1) <= 0 then
      redis.call('HDEL', t.jobs_queued, env.key_id)
    end
  end
  if is_record then
    redis.call('HSET', record, 'status', status, 'started_ms', t.live_at)
    if status == 'expired' then settle_job(record, 0, 0) end
  end
end

local function drop_input(t, env)
  -- only a key under the inputs' prefix (a planted envelope names no other)
  local key = env.input_key
  if type(key) == 'string' and string.sub(key, 1, #t.input_prefix) == t.input_prefix then
    redis.call('DEL', key)
  end
end

local function closes_at_end(raw, from)
  -- whether the JSON string opened just before `from` ends with the
  -- envelope, its closing quote followed by '}' alone: every quote before
  -- it is escaped (an odd run of backslashes before it)
  local at = from
  while true do
    local quote = string.find(raw, '"', at, true)
    if not quote then return false end
    local slashes = 0
    while string.byte(raw, quote - slashes - 1) == 92 do slashes = slashes + 1 end
    if slashes % 2 == 0 then return quote == #raw - 1 and string.byte(raw, -1) == 125 end
    at = quote + 1
  end
end

local function read_head(raw)
  -- An envelope as a gateway queues it (wire.encode_queued), read without
  -- decoding its input (which would cost more than all the rest: a 2 KB
  -- input, 6 µs against 2): every field but the input, then ',"input":'
  -- (the first is the field's: a JSON string holds no bare quote) and the
  -- input, null or one string that ends the object. The input's escapes are
  -- not checked: the worker drops an envelope they make unreadable, alone
  -- (wire.decode_batch). Anything else (an earlier version's, its input in
  -- the middle; one planted) reads nil: decoded whole.
  local at = string.find(raw, ',"input":', 1, true)
  if not at then return nil end
  local ok, env = pcall(cjson.decode, string.sub(raw, 1, at - 1) .. '}')
  if not ok or type(env) ~= 'table' or type(env.deadline_ms) ~= 'number' then return nil end
  if string.byte(raw, at + 9) == 34 and closes_at_end(raw, at + 10) then
    env.input = ''  -- (a string)
  elseif #raw == at + 13 and string.sub(raw, at + 9) == 'null}' then
    env.input = cjson.null
  else
    return nil
  end
  return env
end

local function readable(env)
  return type(env) == 'table' and type(env.deadline_ms) == 'number'
    and type(env.id) == 'string' and type(env.gateway) == 'string'
    and (type(env.input) == 'string'
      or (env.input == cjson.null and type(env.input_key) == 'string'))
end

local function consider(t, raw)
  -- taken (1) or dropped and counted (0), and what was read of it if it was
  -- an object (its key's count goes down in a fair queue either way). (cjson
  -- stops reading at a NUL byte, and JSON escapes one: none is in an
  -- envelope, and one that holds it is dropped.)
  local ok, env = false, nil
  if not string.find(raw, '\0', 1, true) then
    env = read_head(raw)
    ok = env ~= nil
    if not ok then ok, env = pcall(cjson.decode, raw) end
  end
  if not ok or not readable(env) then
    t.malformed = t.malformed + 1
    return 0, ok and type(env) == 'table' and env or nil
  end
  if env.deadline_ms <= t.live_at then
    t.expired = t.expired + 1
    left_queue(t, env, 'expired')
    drop_input(t, env)
    give_back_dropped(t, env)
  elseif t.check_cancelled and redis.call('ZSCORE', t.cancelled_set, env.id) then
    t.cancelled = t.cancelled + 1
    redis.call('ZREM', t.cancelled_set, env.id)
    drop_input(t, env)
    give_back_dropped(t, env)
  else
    t.taken[#t.taken + 1] = raw
    if env.job == true then
      t.jobs = t.jobs + 1
      left_queue(t, env, 'running')
    end
    return 1, env
  end
  return 0, env
end
