-- admit_request: one request of an admit call. It is charged to its key's
-- limits (window.lua) and, if every one has room and its key's share of the
-- tier has room (fair_tag.lua), handed straight to an idle worker
-- (hand_straight.lua) or queued in fair order with the doorbell rung. A
-- request refused by any check is charged to none (nothing to refund; a
-- refund is a charge of minus the cost, always made). A long input is kept
-- beside its envelope (queue/inputs.py), written by the gateway just before
-- the call, deleted by the request if refused.
-- Its keys and arguments (queue/gateway.py's AdmitRequest writes them):
-- KEYS[1..n] the windows  KEYS[n+1] fq:{tier}  KEYS[n+2] doorbell
--   KEYS[n+3] fair:{tier}  (without those three: charge only)
--   KEYS[n+4] the input's key, when one is kept beside
-- ARGV[1] n  ARGV[2] the envelope (when queued)
-- ARGV[5i-2..5i+2] limit i's cost, amount, most in its eleven buckets (its
--   amount and a tenth; a hard bound's, its amount), window (s) or budget
--   period, and for an estimate the least it may be cut to, else 0 (budget.lua)
-- ARGV[5n+3] 0 input in the envelope, 1 kept beside, 2 beside but held back
--   (a refusal expected: admitted, answered 3, nothing done; sent again with it)
-- ARGV[5n+4..5n+8] key id, cost, weight (thousandths), the tier's allowance
--   (0: no share check), the weights the gateway admitted in the last second
-- ARGV[5n+9..5n+13] (to hand it straight) batch id, former, now (epoch ms),
--   the model's key prefix, its tiers (space-separated, highest first)
-- Needs budget.lua, window.lua, fair_tag.lua, hand_straight.lua. Put before admit.lua.
local function parsed(KEYS, ARGV)
  -- the request's arguments by name (its limits: limit_of, read when used;
  -- its hand-off: straight_of, only when tried)
  local n = tonumber(ARGV[1])
  local fa = 5 * n + 4
  return {n = n, keys = KEYS, args = ARGV, queued = #KEYS > n,
    fq = KEYS[n + 1], doorbell = KEYS[n + 2], state = KEYS[n + 3], input_key = KEYS[n + 4],
    beside = ARGV[5 * n + 3] == '1', held_back = ARGV[5 * n + 3] == '2',
    key_id = ARGV[fa], cost = tonumber(ARGV[fa + 1]) or 0,
    weight = tonumber(ARGV[fa + 2]) or 1000, allowance = tonumber(ARGV[fa + 3]) or 0,
    recent = tonumber(ARGV[fa + 4]) or 0, prefix = ARGV[fa + 9] and ARGV[fa + 8]}
end

local function limit_of(r, i)
  -- limit i's key, cost, amount, most in eleven buckets, window (ms) or
  -- budget period ('day', 'week', 'month'), the least an estimate is cut to
  local args, a = r.args, 5 * i - 2
  local window_s = tonumber(args[a + 3])
  return r.keys[i], tonumber(args[a]), tonumber(args[a + 1]), tonumber(args[a + 2]),
    window_s and window_s * 1000 or args[a + 3], tonumber(args[a + 4]) or 0
end

local function straight_of(r)
  -- what hand_straight.lua reads: batch id, former, now, prefix, tiers
  local sa, args = 5 * r.n + 9, r.args
  return {batch_id = args[sa], former = args[sa + 1], formed_ms = args[sa + 2],
    prefix = args[sa + 3], tiers = args[sa + 4], envelope = args[2]}
end

local function reset_ms(w, now)
  -- until the window is as before any charge (its current bucket leaves the
  -- last ten: x-ratelimit-reset-*); a budget's, until its period ends
  if w.budget then return w.ends - now end
  return math.ceil((w.current + 10) * w.window_ms / 10) - now
end

local function checked_limits(windows, r, reply)
  -- each limit's window (the call's copy: windows_at), what it would be
  -- charged and what it asked (an estimate may be cut: budget.lua), whether
  -- all have room, the first without; the reply's counts and ms if refused
  local now, charged, costs, asked, room_all, refused_by = windows.now, {}, {}, {}, true, 0
  for i = 1, r.n do
    local key, cost, amount, allowed, span, least = limit_of(r, i)
    local w = windows.get(key, span, allowed)
    charged[i], costs[i], asked[i] = w, cost, cost
    reply[2 * i + 2] = w.eleven - w.oldest
    reply[2 * i + 3] = (w.eleven ~= 0 or w.budget) and reset_ms(w, now) or -2
    if cost > 0 then
      local fits, wait
      if w.budget then
        fits, wait, costs[i] = budget_room(w, cost, amount, least, now)
      else
        fits, wait = window_room(key, w, cost, amount, allowed, now)
      end
      if not fits then
        room_all = false
        if refused_by == 0 then refused_by = i end
        -- (never: a window's length, a budget's period's end; 0: budget_room)
        if wait < 0 then wait = w.budget and reset_ms(w, now) or span end
        reply[2 * i + 3] = wait
      end
    end
  end
  return charged, costs, asked, room_all, refused_by
end

local function charge_limits(windows, r, charged, costs, asked, reply)
  -- every limit charged (an estimate, what is left of its budget), the
  -- reply's counts and ms after it; returns what estimates were cut by
  local cut = 0
  for i = 1, r.n do
    window_charge(charged[i], costs[i])
    reply[2 * i + 2] = reply[2 * i + 2] + costs[i]
    cut = cut + asked[i] - costs[i]
    if reply[2 * i + 3] < 0 then reply[2 * i + 3] = reset_ms(charged[i], windows.now) end
  end
  return cut
end

local function admit_request(call, KEYS, ARGV)
  -- Returns {admitted (1; 0: over a limit; 2: over its key's share; 3: its
  -- input held back, nothing done), queued, handed straight, count_1,
  -- ms_1, ..., count_n, ms_n, the first limit without room (0: none),
  -- Redis's clock (epoch ms: the buckets charged, settle.lua), what its
  -- estimates were charged less than their cost (budget.lua)}: a
  -- window's last ten buckets' sum after the charge (before it, if
  -- refused), and the ms until it has room again (refused) or until its
  -- oldest charge leaves it (-2: nothing charged).
  local r = parsed(KEYS, ARGV)
  if r.beside and redis.call('EXISTS', r.input_key) == 0 then
    -- Its SET was refused (out of memory, or evicted since): this request
    -- alone fails, charging nothing (base/errors.py reads these words).
    error('ERR its input was not stored (its SET was refused, or it was evicted)', 0)
  end
  local reply, cut = {0, 0, 0}, 0
  local charged, costs, asked, room_all, refused_by = checked_limits(call.windows, r, reply)
  local admitted = room_all and 1 or 0
  local s
  if r.queued and admitted == 1 then
    s = fair_state(call.states, r.state, r.fq, r.key_id)
    if over_share(r.allowance, r.recent, r.fq, s, r.key_id, r.weight) then admitted = 2 end
  end
  if r.held_back and admitted == 1 then admitted = 3 end
  reply[1] = admitted
  if admitted == 1 then
    cut = charge_limits(call.windows, r, charged, costs, asked, reply)
    -- (a key of another type on the way: queued, as without a worker idle)
    local handable, handed = false, false
    if r.queued and r.prefix and not call.no_hand[r.prefix] then
      local h = straight_of(r)
      handable, handed = pcall(hand_straight, h)
      if h.no_worker then call.no_hand[r.prefix] = true end
    end
    if handable and handed then
      reply[3] = 1
    elseif r.queued then
      queue_fairly(r.fq, s, r.key_id, r.args[2], r.cost, r.weight)
      call.ring(r.doorbell)
      reply[2] = 1
      -- (queued: nothing of its model goes straight in this call any more)
      if r.prefix then call.no_hand[r.prefix] = true end
    end
  end
  if r.beside and admitted ~= 1 then redis.call('DEL', r.input_key) end
  reply[2 * r.n + 4], reply[2 * r.n + 5], reply[2 * r.n + 6] = refused_by, call.windows.now, cut
  return reply
end
