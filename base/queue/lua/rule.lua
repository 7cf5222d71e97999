-- rule: reading the batching rule the dispatchers publish (JSON: n,
-- interval_ms, headroom, quiet_ms, min_slots). Put before the scripts
-- that read it (scripts.py: take, admit), so they accept the same rules.
local function published_rule(key, ntiers)
  -- n, interval_ms, headroom, quiet_ms and the minimum slots per tier;
  -- nil if absent or not readable (Redis contents are not trusted)
  local raw = redis.pcall('GET', key)
  if type(raw) ~= 'string' then return nil end
  local ok, rule = pcall(cjson.decode, raw)
  if not ok or type(rule) ~= 'table' or type(rule.min_slots) ~= 'table' then return nil end
  for _, field in ipairs({'n', 'interval_ms', 'headroom', 'quiet_ms'}) do
    if type(rule[field]) ~= 'number' then return nil end
  end
  if not (rule.n >= 1 and rule.n <= 100) then return nil end
  local slots = {}
  for i = 1, ntiers do
    local share = rule.min_slots[i]
    if type(share) ~= 'number' then return nil end
    slots[i] = math.floor(share)
  end
  return math.floor(rule.n), rule.interval_ms, rule.headroom, rule.quiet_ms, slots
end
