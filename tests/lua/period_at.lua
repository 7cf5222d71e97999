-- period_at: budget.lua's period of a moment, for tests/test_budgets.py to
-- hold against base/periods.py. ARGV[1] epoch ms  ARGV[2] the period.
-- Returns {its index, when it ends (epoch ms)}.
local index, ends = period_at(tonumber(ARGV[1]), ARGV[2])
return {index, ends}
