"""Per-key quotas: sliding windows counted in Redis (``admit.lua``: ten
buckets a window, never more than 110 % of a limit in any window-long span),
and budgets over calendar periods (``budget.lua``), so every gateway process
shares one count.

``limits`` parses the policy's rates and names each window's counter; the
counting is ``admit.lua``, which charges a request to all of its limits and
queues it in the same step (one round trip). A request over any limit is
charged to none, so the counters hold exactly what was admitted, whatever
the gateways racing, and a refusal has nothing to refund. The charge also
brings back how long each window has left, for the x-ratelimit-* headers.
"""

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from infergate.base.queue.gateway import Admitted, Counter, GatewayQueue, Place
from infergate.base.queue.inputs import Beside
from infergate.gateway import reservations
from infergate.gateway.costs import CostModel
from infergate.policies import Budget, KeyEntry, Tier
from limits import RateLimitItem, parse_many

# Keys remembered as refused lately (when full, those whose refusal has
# lapsed are forgotten; still full, no more are remembered).
MAX_REFUSED_KEYS = 10_000
# The refusal is over this much sooner than Redis said: a request reaches
# Redis later than the reply that said it came back (the admits' gathering,
# two round trips).
HOLD_EARLY_MS = 25
# ... and over after this long at most: one request then goes with its
# input (a long limit's refusal is not kept for its whole window).
HOLD_MOST_S = 1.0


@lru_cache(maxsize=1024)
def parse_rates(rates: tuple[str, ...]) -> tuple[RateLimitItem, ...]:
    return tuple(item for rate in rates for item in parse_many(rate))


# Each kind of limit: its window's name, and what a refusal calls its unit.
_NAMES = {"requests": "requests", "cost": "chars", "tokens": "tokens"}
_WHAT = {"requests": "requests", "cost": "input characters", "tokens": "tokens"}
# The kinds a request reserves, settled by the tokens it used (the rest: by
# its share of its batch's GPU time, "gpu_budget"); the budgets, refused
# until their period ends.
BY_TOKENS = ("tokens", "token_budget")
BUDGETS = ("token_budget", "gpu_budget")


class Charge(NamedTuple):
    item: RateLimitItem | None  # (a budget has none)
    counter: Counter
    # "requests", "cost" (input characters), "tokens" (a reservation), or a
    # budget's: "token_budget", "gpu_budget" (microseconds reserved)
    kind: str
    what: str  # how a refusal names it

    @property
    def named(self) -> str:
        """The limit, as a message names it after "the key's"."""
        return self.what if self.kind in BUDGETS else f"limit of {self.what}"


@dataclass(frozen=True)
class QuotaResult:
    allowed: bool
    # The request limit closest to running out (for the x-ratelimit-* headers).
    limit: int | None = None
    remaining: int | None = None
    reset_s: float | None = None
    # When refused: which limit, and how long until its window has room.
    refused_by: str | None = None
    retry_after_ms: int | None = None
    # Refused (and charged nothing): its key holds its share of the tier already.
    over_share: bool = False
    # Refused by a budget: nothing is admitted until its period ends, or
    # (``budget_held``) until its reservations in flight settle, which may
    # give back room.
    over_budget: bool = False
    budget_held: bool = False
    # The most used of its budgets (1: refused for one) and when its period
    # ends (Redis's clock, epoch ms), if it has one (``budgets.py``).
    budget_use: tuple[float, int] | None = None
    # The token limit closest to running out (the x-ratelimit-*-tokens headers),
    # and, admitted, the tokens it reserved (given back by ``Quota.settle``).
    tokens: "TokenWindow | None" = None
    reservation: "Reservation | None" = None

    def headers(self) -> dict[str, str]:
        out = {}
        if self.limit is not None and self.remaining is not None and self.reset_s is not None:
            out = {
                "x-ratelimit-limit-requests": str(self.limit),
                "x-ratelimit-remaining-requests": str(self.remaining),
                "x-ratelimit-reset-requests": f"{self.reset_s:.3f}s",
            }
        if self.tokens is not None:
            out.update(self.tokens.headers())
        return out


class TokenWindow(NamedTuple):
    limit: int
    remaining: int
    reset_s: float

    def headers(self) -> dict[str, str]:
        return {
            "x-ratelimit-limit-tokens": str(self.limit),
            "x-ratelimit-remaining-tokens": str(self.remaining),
            "x-ratelimit-reset-tokens": f"{self.reset_s:.3f}s",
        }


@dataclass(frozen=True)
class Reservation:
    """What an admitted request reserved (each counter's cost): tokens in its
    token windows and token budget, GPU microseconds in its GPU budget, as
    Redis's clock read when it charged them (their bucket or period)."""

    by_tokens: tuple[Counter, ...]
    by_gpu: tuple[Counter, ...]
    charged_ms: int

    def units(self) -> list[tuple[Counter, int, str]]:
        """Each counter charged, Redis's clock then, and its unit: "t"
        (tokens), "g" (GPU µs)."""
        return [(c, self.charged_ms, "t") for c in self.by_tokens] + [
            (c, self.charged_ms, "g") for c in self.by_gpu
        ]

    def unused(self, tokens: int, gpu_us: int) -> list[tuple[Counter, int, int]]:
        """What goes back to each counter once the request used ``tokens``
        and ``gpu_us`` (negative: what it used past its reservation,
        charged then; a budget's, 0 or not: its reservation is settled)."""
        return [
            (c, self.charged_ms, c.cost - max(used, 0))
            for counters, used in ((self.by_tokens, tokens), (self.by_gpu, gpu_us))
            for c in counters
            if c.cost != max(used, 0) or c.period
        ]


class Quota:
    def __init__(self, queue: GatewayQueue, slowest_batch_ms: Callable[[], float] = float) -> None:
        self.queue = queue
        # The fleet's slowest batch now (what a cut GPU estimate keeps at least).
        self._slowest_batch_ms = slowest_batch_ms
        # Until when (monotonic s) each key refused lately is expected to be
        # refused again: its long inputs are held back meanwhile.
        self._refused_until: dict[str, float] = {}
        self._pruned_at = -float("inf")
        # What each key's requests cost the GPU (its place in the fair queue).
        self.costs = CostModel()

    def charges(
        self,
        key: KeyEntry,
        tier: Tier,
        input_chars: int,
        tokens: int = 0,
        gpu_us: int = 0,
        calls: int = 1,
    ) -> list[Charge]:
        """The request's charge to each of its key's limits: one request,
        ``input_chars``, ``tokens`` reserved (``reservations.py``), and
        ``gpu_us`` reserved of its GPU budget, for what may run in ``calls``
        (a list's prompts: one each). Only a lone request's GPU estimate may
        be cut to what is left of its budget: a list cut so would run all
        its prompts on what is left of one's (measured: 100 prompts spent
        5.9 s of a 2 s budget), so a list's must fit whole."""
        rates = key.rate_limits if key.rate_limits is not None else tier.rate_limits
        token_rates = key.token_limits if key.token_limits is not None else tier.token_limits
        windows = self._windows(
            key.id, tuple(rates), tier.cost_limit, tuple(token_rates), budget_of(key, tier)
        )
        costs = {
            "cost": input_chars,
            "tokens": tokens,
            "token_budget": tokens,
            "gpu_budget": gpu_us,
        }
        least = min(gpu_us, self._gpu_least(key.id)) if gpu_us and calls == 1 else 0
        return [w if w.kind == "requests" else _costing(w, costs[w.kind], least) for w in windows]

    def _gpu_least(self, key_id: str) -> int:
        line = self.costs.call_line(key_id)
        return reservations.gpu_least(line, self._slowest_batch_ms())

    @staticmethod
    def reserves_tokens(key: KeyEntry, tier: Tier) -> bool:
        """Whether the key's requests reserve tokens (token limits, a token budget)."""
        budget = budget_of(key, tier)
        if budget is not None and budget.tokens is not None:
            return True
        return bool(key.token_limits if key.token_limits is not None else tier.token_limits)

    @staticmethod
    def reserves_gpu(key: KeyEntry, tier: Tier) -> bool:
        """Whether the key's requests reserve GPU time (a GPU budget)."""
        budget = budget_of(key, tier)
        return budget is not None and budget.gpu_seconds is not None

    @lru_cache(maxsize=4096)  # noqa: B019 (one Quota per process, for its life)
    def _windows(
        self,
        key_id: str,
        rates: tuple[str, ...],
        cost_limit: str | None,
        token_rates: tuple[str, ...] = (),
        budget: Budget | None = None,
    ) -> list[Charge]:
        """A key's limits, named once: only the cost of a cost or token
        limit, or of a budget, changes per request."""
        out = [self._charge(item, key_id, "requests", 1) for item in parse_rates(rates)]
        if cost_limit:
            out += [self._charge(item, key_id, "cost", 0) for item in parse_rates((cost_limit,))]
        out += [self._charge(item, key_id, "tokens", 0) for item in parse_rates(token_rates)]
        if budget is not None:
            out += self.budget_charges(key_id, budget)
        # A period written twice for one kind is one window, at its smaller
        # amount (admit.lua reads each window once).
        windows: dict[str, Charge] = {}
        for c in out:
            kept = windows.get(c.counter.key)
            if kept is None or c.counter.amount < kept.counter.amount:
                windows[c.counter.key] = c
        return list(windows.values())

    def budget_charges(self, key_id: str, budget: Budget) -> list[Charge]:
        """A budget's counters (its amount is not in their name: a budget
        raised within a period keeps what was spent in it)."""
        out = []
        period = budget.period
        if budget.tokens is not None:
            name = self.queue.counter_key(f"budget/{key_id}/tokens/{period}")
            counter = Counter(name, 0, budget.tokens, 0, True, period)
            out.append(
                Charge(
                    None, counter, "token_budget", f"budget of {budget.tokens} tokens a {period}"
                )
            )
        if budget.gpu_seconds is not None:
            name = self.queue.counter_key(f"budget/{key_id}/gpu_us/{period}")
            amount = round(budget.gpu_seconds * 1e6)
            counter = Counter(name, 0, amount, 0, True, period, least=1)
            what = f"budget of {budget.gpu_seconds:g} GPU seconds a {period}"
            out.append(Charge(None, counter, "gpu_budget", what))
        return out

    def _charge(self, item: RateLimitItem, key_id: str, kind: str, cost: int) -> Charge:
        """A limit's window, named by its key, kind and length in seconds, not
        its amount (as a budget's counter is) nor how its period is written:
        a limit edited live counts what its window holds already, where a
        new name started it over (measured: 3,320 tokens within 2.6 s of a
        limit lowered from 2,000 to 1,500, and 3,823 of one rewritten from
        a minute to 60 seconds)."""
        name = f"LIMITER/{key_id}/{_NAMES[kind]}/{item.get_expiry()}s"
        counter = Counter(
            self.queue.counter_key(name), cost, item.amount, item.get_expiry(), kind == "tokens"
        )
        return Charge(item, counter, kind, f"{item} ({_WHAT[kind]})")

    async def charge(
        self,
        key: KeyEntry,
        tier: Tier,
        input_chars: int,
        queue_on: str | None = None,
        envelope: bytes = b"",
        beside: Beside | None = None,
        allowance: float = 0.0,
        recent_weight: float = 0.0,
        tokens: int = 0,
        gpu_us: int = 0,
    ) -> QuotaResult:
        """Charge the request to its key's limits; with ``queue_on`` (a tier),
        queue ``envelope`` there too (and store its long input ``beside`` it),
        in the same step, if it was admitted: its key's limits have room, and
        the key holds less than its weight's share of ``allowance`` (or hand
        it straight to an idle worker: ``GatewayQueue.admit``). ``recent_weight``:
        the weights of the tier's keys admitted lately (``Place``); ``tokens``
        and ``gpu_us``: what it reserves of its token limits and budgets."""
        charges = self.charges(key, tier, input_chars, tokens, gpu_us)
        if not charges and queue_on is None:
            return QuotaResult(True)
        cost = self.costs.expected(key.id, input_chars)
        place = Place(key.id, cost, key.weight, allowance, recent_weight)
        hold = beside is not None and self._refused_lately(key.id)
        admitted = await self.queue.admit(
            [c.counter for c in charges], queue_on, envelope, True, beside, place, hold
        )
        if admitted.over_share:
            return QuotaResult(False, over_share=True)
        result = _result(charges, admitted)
        refused_by = admitted.refused_by
        if result.retry_after_ms and refused_by >= 0 and charges[refused_by].kind == "requests":
            self._refused(key.id, result.retry_after_ms)
        return result

    def _refused_lately(self, key_id: str) -> bool:
        until = self._refused_until.get(key_id)
        return until is not None and time.monotonic() < until

    def _refused(self, key_id: str, retry_after_ms: int) -> None:
        """A refusal by a request limit (whatever its size, the key's next
        request is refused too; not so for a cost limit): expected again
        until the limit has room (``retry_after_ms``), less the moment an
        admit takes to reach Redis (one held back that finds room goes
        twice), and for ``HOLD_MOST_S`` at most."""
        now = time.monotonic()
        if key_id not in self._refused_until and len(self._refused_until) >= MAX_REFUSED_KEYS:
            if now - self._pruned_at < HOLD_MOST_S:
                return  # (full of refusals that are still on: this one is not remembered)
            self._pruned_at = now
            self._refused_until = {k: t for k, t in self._refused_until.items() if t > now}
            if len(self._refused_until) >= MAX_REFUSED_KEYS:
                return
        hold_s = min((retry_after_ms - HOLD_EARLY_MS) / 1000.0, HOLD_MOST_S)
        self._refused_until[key_id] = now + hold_s

    async def refund(self, key: KeyEntry, tier: Tier, input_chars: int, requests: int = 1) -> None:
        """Give back what ``charge`` took for ``requests`` refused after it
        (a job over its key's queued bound, a list of prompts that failed):
        a charge of minus the cost."""
        charges = self._for_many(self.charges(key, tier, input_chars), requests)
        await self.queue.admit([c.counter._replace(cost=-c.counter.cost) for c in charges])

    async def settle(self, reservation: "Reservation | None", tokens: int, gpu_us: int) -> None:
        """Give back to its counters what a reservation did not use, once its
        request used ``tokens`` and ``gpu_us``."""
        if reservation is not None and (unused := reservation.unused(tokens, gpu_us)):
            await self.queue.settle(unused)

    async def charge_list(
        self, key: KeyEntry, tier: Tier, input_chars: list[int], tokens: int = 0, gpu_us: int = 0
    ) -> QuotaResult:
        """Charge ``len(input_chars)`` requests at once, in one step: all of
        them, or none if any limit lacks room for all (``tokens``, ``gpu_us``:
        what they reserve together)."""
        calls = len(input_chars)
        charges = self._for_many(
            self.charges(key, tier, sum(input_chars), tokens, gpu_us, calls), calls
        )
        if not charges:
            return QuotaResult(True)
        return _result(charges, await self.queue.admit([c.counter for c in charges]))

    def over_as_a_whole(
        self, key: KeyEntry, tier: Tier, input_chars: list[int], tokens: int = 0, gpu_us: int = 0
    ) -> Charge | None:
        """The limit that ``input_chars`` (requests at once, reserving
        ``tokens`` and ``gpu_us``) are over even in an empty window or
        period, if one is: no wait makes room for them (an estimate, cut to
        what is left, always fits an untouched budget)."""
        for c in self.charges(key, tier, sum(input_chars), tokens, gpu_us, len(input_chars)):
            need = len(input_chars) if c.kind == "requests" else c.counter.cost
            if need > c.counter.amount and not c.counter.least:
                return c
        return None

    @staticmethod
    def _for_many(charges: list[Charge], requests: int) -> list[Charge]:
        """Charges of ``requests`` requests (a cost limit's is already their total)."""
        if requests == 1:
            return charges
        return [
            c if c.kind != "requests" else c._replace(counter=c.counter._replace(cost=requests))
            for c in charges
        ]


def budget_of(key: KeyEntry, tier: Tier) -> Budget | None:
    """The key's budget: its own, or else its tier's."""
    return key.budget if key.budget is not None else tier.budget


def _costing(charge: Charge, cost: int, least: int) -> Charge:
    """A cost limit's charge for this request's cost (built directly: a
    namedtuple's ``_replace`` costs more than the rest of the charge), and
    an estimate's, the least it may be cut to (at most a share of its
    budget: ``reservations.LEAST_AT_MOST``)."""
    key, _, amount, window_s, hard, period, cut = charge.counter
    if cut:
        least = min(least, max(1, round(amount * reservations.LEAST_AT_MOST)))
    counter = Counter(key, cost, amount, window_s, hard, period, least if cut else 0)
    return Charge(charge.item, counter, charge.kind, charge.what)


def _result(charges: list[Charge], admitted: Admitted) -> QuotaResult:
    """The headers' limits (the request and token limits closest to running
    out), what was reserved, and the first limit that refused, if one did."""
    result = _requests_result(charges, admitted)
    if not charges or charges[-1].kind in ("requests", "cost"):  # (reserving ones come last)
        return result
    windows = [
        (c, count, ttl_ms)
        for c, count, ttl_ms in zip(charges, admitted.counts, admitted.ttls_ms, strict=True)
        if c.kind == "tokens"
    ]
    tokens = None
    if windows:
        charge, count, ttl_ms = min(windows, key=lambda w: w[0].counter.amount - w[1])
        amount = charge.counter.amount
        tokens = TokenWindow(amount, max(0, amount - count), _left_s(charge, ttl_ms))
    budgets = [
        (count / c.counter.amount, admitted.now_ms + ttl_ms)
        for c, count, ttl_ms in zip(charges, admitted.counts, admitted.ttls_ms, strict=True)
        if c.kind in BUDGETS
    ]
    budget_use = max(budgets) if budgets else None
    if budget_use is not None and result.over_budget and not result.budget_held:
        budget_use = (1.0, budget_use[1])
    reservation = None
    if admitted.admitted:
        by_tokens = tuple(c.counter for c in charges if c.kind in BY_TOKENS and c.counter.cost > 0)
        by_gpu = tuple(
            # (charged what was left of it, where that was less: ``Counter.least``)
            c.counter._replace(cost=c.counter.cost - admitted.cut)
            for c in charges
            if c.kind == "gpu_budget" and c.counter.cost > 0
        )
        if by_tokens or by_gpu:
            reservation = Reservation(by_tokens, by_gpu, admitted.now_ms)
    return dataclasses.replace(
        result, tokens=tokens, reservation=reservation, budget_use=budget_use
    )


def _requests_result(charges: list[Charge], admitted: Admitted) -> QuotaResult:
    """The request limit closest to running out, and the first limit that
    refused, if one did."""
    # The usual case, one request limit (a cost limit or not; request limits
    # come first): no search.
    one_request_limit = len(charges) == 1 or (len(charges) > 1 and charges[1].kind != "requests")
    if admitted.admitted and one_request_limit and charges[0].kind == "requests":
        amount = charges[0].counter.amount
        left_s = _left_s(charges[0], admitted.ttls_ms[0])
        return QuotaResult(True, amount, max(0, amount - admitted.counts[0]), left_s)
    windows = list(zip(charges, admitted.counts, admitted.ttls_ms, strict=True))
    limit = remaining = None
    reset_s = None
    requests = [w for w in windows if w[0].kind == "requests"]
    if requests:
        charge, count, ttl_ms = min(requests, key=lambda w: w[0].counter.amount - w[1])
        limit, remaining = charge.counter.amount, max(0, charge.counter.amount - count)
        reset_s = _left_s(charge, ttl_ms)
    if admitted.admitted:
        return QuotaResult(True, limit, remaining, reset_s)
    charge, _, ttl_ms = windows[max(admitted.refused_by, 0)]
    return QuotaResult(
        False,
        limit,
        remaining,
        reset_s,
        refused_by=charge.what,
        retry_after_ms=max(1, math.ceil(_left_s(charge, ttl_ms) * 1000)),
        over_budget=charge.kind in BUDGETS,
        # (a budget's refusal waits for its period's end, or 0: budget.lua)
        budget_held=charge.kind in BUDGETS and ttl_ms == 0,
    )


def _left_s(charge: Charge, ttl_ms: int) -> float:
    """What is left of a window; a window not open yet is all there is."""
    return ttl_ms / 1000.0 if ttl_ms >= 0 else float(charge.counter.window_s)
