"""Which keys are near or at their budget, as this gateway saw them charged:
the alert series ``infergate_budget_keys``, counted at a scrape. A key is
remembered until its budget's period ends (its count then starts over), and
a gateway sees only the keys it serves, so the alert takes the highest of
the gateways'. Bounded by the policy's keys: only an authenticated key is
charged."""

from infergate.base import clock

# The marks the series counts keys at: 80 % of a budget used, and all of it
# (a request refused for its budget).
MARKS = (0.8, 1.0)


class BudgetWatch:
    def __init__(self) -> None:
        self._use: dict[str, tuple[float, int]] = {}  # key id: (use, its period's end)

    def seen(self, key_id: str, use: float, ends_ms: int) -> None:
        """A key's budgets were charged (or refused): the most used of them."""
        self._use[key_id] = (use, ends_ms)

    def keys_at(self, mark: float) -> int:
        """How many keys have used at least ``mark`` of a budget this period."""
        now_ms = clock.now_ms()
        ended = [key for key, (_, ends_ms) in self._use.items() if ends_ms <= now_ms]
        for key in ended:
            del self._use[key]
        return sum(use >= mark for use, _ in self._use.values())
