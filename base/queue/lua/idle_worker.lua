-- idle_worker: the oldest idle live worker's credit, and its hand-off list,
-- as a dispatcher would take it. Put before the scripts that hand a batch
-- off without a dispatcher (scripts.py: admit, retry), so they choose as one.
local function idle_worker(ready, heartbeat_prefix, handoff_prefix)
  -- the credit (popped off `ready`) and its worker's batches:{worker}; nil
  -- if no live worker is idle. A credit whose worker's heartbeat is gone is
  -- dropped; one whose hand-off list is a key of another type (Redis
  -- contents are not trusted) goes back, and nil is returned.
  local credit = redis.call('RPOP', ready)
  while credit and redis.call('EXISTS', heartbeat_prefix .. credit) == 0 do
    credit = redis.call('RPOP', ready)
  end
  if not credit then return nil end
  local handoff = handoff_prefix .. credit
  local kind = redis.call('TYPE', handoff)['ok']
  if kind ~= 'list' and kind ~= 'none' then
    redis.call('RPUSH', ready, credit)
    return nil
  end
  return credit, handoff
end
