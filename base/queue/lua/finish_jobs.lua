-- finish_jobs: store the results of finished jobs on their records (kept
-- for the record's result ttl from now) and say so on the jobs-done channel,
-- in one step. A record already gone (its owner's time passed) is left
-- gone. A record already final (succeeded, failed, cancelled, expired) is
-- left as it is: a client may have read it, and a final status never changes
-- (a batch run twice, or answered by the reaper and then by its worker,
-- keeps its first result).
-- Run by the worker in the same transaction that acknowledges the batch,
-- and by the reaper before it dead-letters one.
-- KEYS[i] job:{id}
-- ARGV[1] jobs-done channel  ARGV[2] now (epoch ms)
-- ARGV[2 + i] the result of KEYS[i] (JSON)  ARGV[2 + #KEYS + i] its status
-- A record that is not a job's (another type) is left as it is: this runs
-- in the transaction that answers a batch, and an error here would fail
-- that answer for ever (Redis contents are not trusted).
-- A job that reserved of its key's token limits or budgets settles
-- (give_back.lua's settle_job) by what its result says it used: its input
-- and output tokens (its input's bound if the worker did not count it) and
-- its share of its call's GPU time; a failed one, nothing.
-- Returns how many records were written.
local final = {succeeded = true, failed = true, cancelled = true, expired = true}

local function used(record, result, status)
  -- the tokens and GPU µs a job's result says it used (none if it failed)
  local ok, r = pcall(cjson.decode, result)
  if status ~= 'succeeded' or not ok or type(r) ~= 'table' then return 0, 0 end
  local function n(x) x = finite(x); return x and x > 0 and math.floor(x) or 0 end
  local input = n(r.input_tokens)
  if input == 0 then input = n(redis.call('HGET', record, 'input_bound')) end
  local gpu = (r.served_by == nil or r.served_by == 'model') and n(r.gpu_us) or 0
  return input + n(r.tokens), gpu
end

local written, ids = 0, {}
for i, key in ipairs(KEYS) do
  local status = redis.call('TYPE', key)['ok'] == 'hash' and redis.call('HGET', key, 'status')
  if status and not final[status] then
    local ttl = tonumber(redis.call('HGET', key, 'result_ttl_ms'))
    if not ttl or ttl <= 0 or ttl > 31536000000 or ttl ~= math.floor(ttl) then ttl = 600000 end
    redis.call('HSET', key, 'status', ARGV[2 + #KEYS + i], 'result', ARGV[2 + i],
      'done_ms', ARGV[2])
    redis.call('PEXPIRE', key, ttl)
    settle_job(key, used(key, ARGV[2 + i], ARGV[2 + #KEYS + i]))
    written = written + 1
    ids[#ids + 1] = key
  end
end
if #ids > 0 then redis.call('PUBLISH', ARGV[1], table.concat(ids, ' ')) end
return written
