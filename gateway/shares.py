"""What each key got at this gateway: its refusals, and its requests
answered here without a worker (from the result cache, or joined to an
identical one in flight), added to usage per key (``usage.py``) a few
times a minute, never a Redis command per request;
every 10 s, how evenly the keys a tier had to refuse were served (Jain's
index of their admitted requests over their weights), for the metrics: a
label per key would not scale in Prometheus, a number per tier does; and
the weights of the keys a tier admitted in the last second, which share its
slots even while they have nothing waiting (``admit.lua``'s share check).
Refusals and recent weights are per model (each model's usage, each
model's slots); the fairness index is per tier, across models."""

from collections import Counter
from collections.abc import Callable

from infergate.base import clock
from infergate.base.keys import DEFAULT_MODEL
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
    def __init__(self, store_for: Callable[[str, str], Store], metrics: GatewayMetrics) -> None:
        self.store_for = store_for  # (model, key id): where the key's usage is kept
        self.metrics = metrics
        # What is not in usage yet, by (model, key id, tier): its refusals,
        # and what it was answered here (``answered_here``).
        self._unsent: dict[tuple[str, str, str], usage.Charge] = {}
        # This window's, by (key id, tier, weight).
        self._admitted: Counter[tuple[str, str, float]] = Counter()
        self._refused: Counter[tuple[str, str, float]] = Counter()
        self._window_started = clock.monotonic_s()
        # Per (model, tier): key id -> (when last admitted, its weight), and the
        # sum of the weights of the recent ones (recomputed at most every 100 ms).
        self._recent: dict[tuple[str, str], dict[str, tuple[float, float]]] = {}
        self._recent_weight: dict[tuple[str, str], tuple[float, float]] = {}

    def admitted(self, key: KeyEntry, model: str = DEFAULT_MODEL) -> None:
        name = (key.id, key.tier, key.weight)
        if len(self._admitted) < MAX_KEYS or name in self._admitted:
            self._admitted[name] += 1
        recent = self._recent.setdefault((model, key.tier), {})
        if len(recent) < MAX_KEYS or key.id in recent:
            recent[key.id] = (clock.monotonic_s(), key.weight)

    def recent_weight(
        self,
        tier: str,
        now_s: Callable[[], float] = clock.monotonic_s,
        model: str = DEFAULT_MODEL,
    ) -> float:
        """The weights of the keys of ``tier`` admitted here to ``model`` in the last second."""
        now = now_s()
        at, total = self._recent_weight.get((model, tier), (float("-inf"), 0.0))
        if now - at >= 0.1:
            recent = self._recent.get((model, tier), {})
            for key_id in [k for k, (seen, _) in recent.items() if now - seen > RECENT_S]:
                del recent[key_id]
            total = sum(weight for _, weight in recent.values())
            self._recent_weight[model, tier] = (now, total)
        return total

    def refused(self, key: KeyEntry, model: str = DEFAULT_MODEL) -> None:
        name = (key.id, key.tier, key.weight)
        if len(self._refused) < MAX_KEYS or name in self._refused:
            self._refused[name] += 1
        self._add(model, usage.Charge(key.id, key.tier, refused=1))

    def answered_here(
        self, key: KeyEntry, model: str, chars: int, input_tokens: int, output_tokens: int
    ) -> None:
        """A request of ``key`` answered at this gateway without a worker
        (no GPU time): from the cache, or joined to one in flight."""
        self._add(
            model, usage.Charge(key.id, key.tier, 1, chars, 0, 0, input_tokens, output_tokens)
        )

    def _add(self, model: str, charge: usage.Charge) -> None:
        name = (model, charge.key_id, charge.tier)
        held = self._unsent.get(name)
        if held is not None:
            self._unsent[name] = _sum(held, charge)
        elif len(self._unsent) < MAX_KEYS:
            self._unsent[name] = charge

    async def flush(self, retention_s: int) -> None:
        """Add what was counted since the last flush to usage per key (kept
        for the next one if Redis fails), and close the window if due."""
        self._close_window()
        unsent, self._unsent = self._unsent, {}
        by_store: dict[tuple[str, int], tuple[Store, list[usage.Charge]]] = {}
        for (model, key_id, _), charge in unsent.items():
            store = self.store_for(model, key_id)
            _, charges = by_store.setdefault((model, id(store.redis)), (store, []))
            charges.append(charge)
        failed: BaseException | None = None
        for (model, _), (store, charges) in by_store.items():
            try:  # (each shard on its own: one that is down keeps only its own)
                await usage.charge(store, charges, clock.now_ms(), retention_s)
            except BaseException as exc:
                failed = exc
                continue
            for charge in charges:
                del unsent[model, charge.key_id, charge.tier]
        if failed is not None:
            for (model, _, _), charge in unsent.items():
                self._add(model, charge)
            raise failed

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


def _sum(a: usage.Charge, b: usage.Charge) -> usage.Charge:
    """Two charges of one key as one."""
    return usage.Charge(a.key_id, a.tier, *(x + y for x, y in zip(a[2:], b[2:], strict=True)))
