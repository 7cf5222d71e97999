"""What each key got at this gateway: its refusals, added to usage per key
(``usage.py``) a few times a minute, never a Redis command per request;
every 10 s, how evenly the keys a tier had to refuse were served (Jain's
index of their admitted requests over their weights), for the metrics: a
label per key would not scale in Prometheus, a number per tier does; and
the weights of the keys a tier admitted in the last second, which share its
slots even while they have nothing waiting (``admit.lua``'s share check)."""

from collections import Counter
from collections.abc import Callable

from infergate.base import clock
from infergate.base.metrics import GatewayMetrics
from infergate.base.queue import usage
from infergate.base.queue.store import Store
from infergate.base.tiers import TIERS
from infergate.policies import KeyEntry

WINDOW_S = 10.0
# Keys counted at once; past it, a new key's refusals are not added to usage
# until the next flush (the metrics count every refusal).
MAX_KEYS = 10_000
# A key admitted this recently still takes its share of its tier's slots.
RECENT_S = 1.0


def jain(values: list[float]) -> float:
    """Jain's fairness index: 1 when all are equal, 1/n when one has all."""
    square_sum = sum(v * v for v in values)
    if len(values) < 2 or square_sum == 0:
        return 1.0
    return sum(values) ** 2 / (len(values) * square_sum)


class Shares:
    def __init__(self, store: Store, metrics: GatewayMetrics) -> None:
        self.store = store
        self.metrics = metrics
        self._unsent: Counter[tuple[str, str]] = Counter()  # refusals not in usage yet
        # This window's, by (key id, tier, weight).
        self._admitted: Counter[tuple[str, str, float]] = Counter()
        self._refused: Counter[tuple[str, str, float]] = Counter()
        self._window_started = clock.monotonic_s()
        # Per tier: key id -> (when last admitted, its weight), and the sum of
        # the weights of the recent ones (recomputed at most every 100 ms).
        self._recent: dict[str, dict[str, tuple[float, float]]] = {t: {} for t in TIERS}
        self._recent_weight: dict[str, tuple[float, float]] = {}

    def admitted(self, key: KeyEntry) -> None:
        name = (key.id, key.tier, key.weight)
        if len(self._admitted) < MAX_KEYS or name in self._admitted:
            self._admitted[name] += 1
        recent = self._recent[key.tier]
        if len(recent) < MAX_KEYS or key.id in recent:
            recent[key.id] = (clock.monotonic_s(), key.weight)

    def recent_weight(self, tier: str, now_s: Callable[[], float] = clock.monotonic_s) -> float:
        """The weights of the keys of ``tier`` admitted here in the last second."""
        now = now_s()
        at, total = self._recent_weight.get(tier, (float("-inf"), 0.0))
        if now - at >= 0.1:
            recent = self._recent[tier]
            for key_id in [k for k, (seen, _) in recent.items() if now - seen > RECENT_S]:
                del recent[key_id]
            total = sum(weight for _, weight in recent.values())
            self._recent_weight[tier] = (now, total)
        return total

    def refused(self, key: KeyEntry) -> None:
        name = (key.id, key.tier, key.weight)
        if len(self._refused) < MAX_KEYS or name in self._refused:
            self._refused[name] += 1
        if len(self._unsent) < MAX_KEYS or (key.id, key.tier) in self._unsent:
            self._unsent[key.id, key.tier] += 1

    async def flush(self, retention_s: int) -> None:
        """Add the refusals counted since the last flush to usage per key
        (kept for the next one if Redis fails), and close the window if due."""
        self._close_window()
        unsent, self._unsent = self._unsent, Counter()
        charges = [usage.Charge(k, t, refused=n) for (k, t), n in unsent.items()]
        try:
            await usage.charge(self.store, charges, clock.now_ms(), retention_s)
        except BaseException:
            self._unsent.update(unsent)
            raise

    def _close_window(self) -> None:
        if clock.monotonic_s() - self._window_started < WINDOW_S:
            return
        for tier in TIERS:
            refused = [k for k in self._refused if k[1] == tier]
            shares = [self._admitted[k] / k[2] for k in refused]
            self.metrics.fairness.labels(tier).set(jain(shares))
            self.metrics.keys_refused.labels(tier).set(len(refused))
        self._admitted.clear()
        self._refused.clear()
        self._window_started = clock.monotonic_s()
