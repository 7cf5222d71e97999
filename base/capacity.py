"""What a deployment costs, from what a sweep measured, and what it needs.

A role's CPU (in cores) is modelled as ``idle + per_request * rate +
per_batch * batches_per_s``: a fixed cost of its processes (heartbeats,
polls), a cost per request (parsing, the admit, the answer), and a cost per
batch that the batch's requests share (the take, the hand-off). The sweep
measures each role's CPU at several rates (and so several batch sizes) and
fits the three by least squares (``fit``); ``plan`` sizes a deployment from
them. The model is linear in the input's length between the sizes measured.
"""

import itertools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

# The roles whose CPU a sweep measures (the load generator's is the client's).
ROLES = ("gateway", "dispatcher", "worker", "redis")


@dataclass(frozen=True)
class RoleCost:
    idle_cores: float  # with no traffic, for the processes the sweep ran
    per_request_us: float
    per_batch_us: float

    def cores(self, rate: float, batch: float) -> float:
        """Cores busy at ``rate`` requests/s in batches of ``batch``, past the idle cost."""
        return (self.per_request_us * rate + self.per_batch_us * rate / max(batch, 1.0)) / 1e6


@dataclass(frozen=True)
class Measured:
    """One input length's costs, with the stack they were measured on."""

    input_chars: int
    roles: dict[str, RoleCost]
    loadgen_us: float  # the load generator's CPU per request (on the same machine)
    workers: int
    gateways: int
    batch_ms: float
    max_batch: int
    cores: int  # the machine's


@dataclass(frozen=True)
class Costs:
    machine: str
    measured: list[Measured] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: object) -> "Costs":
        """Read a costs file's contents; ValueError if it is not one."""
        try:
            if not isinstance(data, dict) or not isinstance(data["measured"], list):
                raise TypeError("no list of measurements")
            costs = cls(str(data["machine"]), [_measured(m) for m in data["measured"]])
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a costs file ({type(exc).__name__}: {exc})") from None
        if not costs.measured:
            raise ValueError("the costs file holds no measurement")
        return costs

    def with_measured(self, new: Measured) -> "Costs":
        """These costs with ``new`` in place of any measured at its input length."""
        kept = [m for m in self.measured if m.input_chars != new.input_chars]
        return Costs(self.machine, sorted([*kept, new], key=lambda m: m.input_chars))

    def at(self, input_chars: int) -> dict[str, RoleCost]:
        """Each role's costs at ``input_chars``: linear between (and beyond)
        the two nearest lengths measured; as measured if only one was."""
        ms = sorted(self.measured, key=lambda m: abs(m.input_chars - input_chars))[:2]
        if len(ms) == 1 or ms[0].input_chars == ms[1].input_chars:
            return ms[0].roles
        a, b = sorted(ms, key=lambda m: m.input_chars)
        t = (input_chars - a.input_chars) / (b.input_chars - a.input_chars)

        def mix(x: float, y: float) -> float:
            return max(0.0, x + (y - x) * t)

        return {
            r: RoleCost(
                a.roles[r].idle_cores,
                mix(a.roles[r].per_request_us, b.roles[r].per_request_us),
                mix(a.roles[r].per_batch_us, b.roles[r].per_batch_us),
            )
            for r in ROLES
        }


def _measured(m: dict[str, object]) -> Measured:
    roles = m["roles"]
    if not isinstance(roles, dict):
        raise TypeError("roles is not a mapping")
    sizes = {
        k: int(_count(m[k])) for k in ("input_chars", "workers", "gateways", "max_batch", "cores")
    }
    if min(sizes["workers"], sizes["max_batch"], sizes["cores"]) <= 0 or _count(m["batch_ms"]) < 1:
        raise TypeError("workers, max_batch and cores must be above 0, batch_ms 1 or more")
    return Measured(
        roles={r: RoleCost(**{k: _count(v) for k, v in roles[r].items()}) for r in ROLES},
        loadgen_us=_count(m["loadgen_us"]),
        batch_ms=_count(m["batch_ms"]),
        **sizes,
    )


# The most any number of a costs file may be (cores, µs, counts): far past
# any machine's, and small enough that no sum or product of them overflows.
MAX_COST = 1e12


def _count(value: object) -> float:
    """A cost file's number: 0 to ``MAX_COST`` (TypeError otherwise)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{str(value)[:40]!r} is not a number")
    if not 0 <= value <= MAX_COST:  # (False for NaN; an int of any size compares)
        raise TypeError(f"{str(value)[:40]!r} is not a number from 0 to {MAX_COST:g}")
    return float(value)


def fit(points: Sequence[tuple[float, float, float]]) -> RoleCost:
    """``(rate, batch, cores)`` points to the role's costs: least squares
    with every coefficient at 0 or more (the best fit among the subsets of
    coefficients whose own fit is not negative)."""
    best: tuple[float, RoleCost] | None = None
    for used in itertools.product((True, False), repeat=3):
        coefs = _least_squares(points, used)
        if coefs is None or min(coefs) < 0:
            continue
        idle, per_request, per_batch = coefs
        cost = RoleCost(round(idle, 4), round(per_request * 1e6, 1), round(per_batch * 1e6, 1))
        error = sum((cost.idle_cores + cost.cores(r, b) - y) ** 2 for r, b, y in points)
        if best is None or error < best[0] - 1e-15:
            best = (error, cost)
    assert best is not None  # (all three unused: zeros, a valid fit)
    return best[1]


def _least_squares(
    points: Sequence[tuple[float, float, float]], used: tuple[bool, ...]
) -> list[float] | None:
    """Coefficients of (1, rate, batches/s) for the columns ``used`` (0 for
    the others); None if those columns do not determine them."""
    rows = [[1.0, r, r / max(b, 1.0)] for r, b, _ in points]
    cols = [i for i in range(3) if used[i]]
    out = [0.0, 0.0, 0.0]
    if not cols:
        return out
    # The normal equations, solved by Gaussian elimination.
    a = [[sum(row[i] * row[j] for row in rows) for j in cols] for i in cols]
    y = [sum(row[i] * p[2] for row, p in zip(rows, points, strict=True)) for i in cols]
    n = len(cols)
    for k in range(n):
        pivot = max(range(k, n), key=lambda i: abs(a[i][k]))
        if abs(a[pivot][k]) < 1e-12 * max(1.0, max(abs(v) for row in a for v in row)):
            return None
        a[k], a[pivot], y[k], y[pivot] = a[pivot], a[k], y[pivot], y[k]
        for i in range(k + 1, n):
            f = a[i][k] / a[k][k]
            a[i] = [x - f * z for x, z in zip(a[i], a[k], strict=True)]
            y[i] -= f * y[k]
    solved = [0.0] * n
    for k in reversed(range(n)):
        solved[k] = (y[k] - sum(a[k][j] * solved[j] for j in range(k + 1, n))) / a[k][k]
    for c, v in zip(cols, solved, strict=True):
        out[c] = v
    return out


@dataclass(frozen=True)
class Target:
    rps: float
    peak: float
    input_chars: int
    batch_ms: float
    max_batch: int
    utilization: float


@dataclass(frozen=True)
class Plan:
    peak_rps: float
    workers: int  # GPUs: one worker each
    batch_at_peak: float
    batch_at_average: float
    gateway_cores: int
    dispatchers: int
    shards: int
    worker_host_cores: float
    cores_at_peak: dict[str, float]


def plan(costs: Costs, target: Target) -> Plan:
    """What serves ``target.rps * target.peak`` with every role at most
    ``target.utilization`` busy: the workers at that share of full batches
    (paced batches hold rate x batch time / workers each), one core per
    gateway process, dispatcher and Redis shard (a shard's scripts run on
    one thread; a dispatcher process serves every shard)."""
    roles = costs.at(target.input_chars)
    peak = target.rps * target.peak
    per_worker = target.max_batch * 1000.0 / target.batch_ms  # requests/s, full batches
    workers = max(1, math.ceil(peak / (per_worker * target.utilization)))
    batch = min(float(target.max_batch), peak * target.batch_ms / 1000.0 / workers)
    average = min(float(target.max_batch), target.rps * target.batch_ms / 1000.0 / workers)
    busy = {r: roles[r].cores(peak, batch) for r in ROLES}

    def processes(role: str) -> int:
        return max(1, math.ceil(busy[role] / target.utilization))

    shards = processes("redis")
    return Plan(
        peak_rps=peak,
        workers=workers,
        batch_at_peak=round(batch, 1),
        batch_at_average=round(average, 1),
        gateway_cores=processes("gateway"),
        dispatchers=processes("dispatcher"),
        shards=shards,
        worker_host_cores=round(busy["worker"], 2),
        cores_at_peak={r: round(v, 2) for r, v in busy.items()},
    )


def ceiling(costs: Costs, input_chars: int) -> float:
    """The rate at which the stack a sweep ran (its workers, its batch time,
    and the load generator beside it) would use every core of the machine
    it was measured on: the rate this machine tops out at."""
    m = min(costs.measured, key=lambda x: abs(x.input_chars - input_chars))
    roles = costs.at(input_chars)
    idle = sum(r.idle_cores for r in roles.values())

    def used(rate: float) -> float:
        batch = min(float(m.max_batch), rate * m.batch_ms / 1000.0 / m.workers)
        busy = sum(roles[r].cores(rate, batch) for r in ROLES)
        return idle + busy + m.loadgen_us * rate / 1e6

    low, high = 0.0, m.workers * m.max_batch * 1000.0 / m.batch_ms  # the workers' own bound
    if used(high) <= m.cores:
        return high
    while high - low > 1e-6 * high:
        mid = (low + high) / 2
        low, high = (mid, high) if used(mid) <= m.cores else (low, mid)
    return low
