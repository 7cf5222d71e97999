"""How long a backend call takes, as the worker measures it: a model fitted
to its recent calls, ``ms = a + b * inputs + c * characters``, by least
squares (a GPU batch costs about the same whatever its size; a model on CPU
costs per input and per character, a batch of 64 inputs of 2,000 characters
thirty times a single short one).

It says two things: the time of a *full* batch of inputs as long as the
recent ones (its heartbeat's ``batch_ms``, from which admission and the
autoscaler compute capacity: a fleet that ran small batches of late is not
taken for one that runs full ones that fast), and how long a call may run
before it is hung (a multiple of what it should take, with a floor).
"""

from collections import deque

RECENT_CALLS = 32
# Once RECENT_CALLS are kept, the fit is made again every this many calls,
# not after each (a fit in Python costs a fast model a tenth of its
# batches' CPU; an eighth of the calls it is fitted on moves it little).
REFIT_EVERY = 8
HANG_MULTIPLE = 4
# Before any call of real inputs: the warm-up's inputs' length.
DEFAULT_CHARS = 512.0


class BatchTimes:
    def __init__(self, hang_floor_ms: int) -> None:
        self.hang_floor_ms = hang_floor_ms
        self._recent: deque[tuple[int, int, float]] = deque(maxlen=RECENT_CALLS)
        # The warm-up's calls (one input, and a full batch), kept beside the
        # recent ones so the fit always spans a small and a full batch.
        self._anchors: list[tuple[int, int, float]] = []
        self._fit: tuple[float, float, float] | None = None
        self._unfitted = 0  # calls since the fit was made
        self._slowest: float | None = None

    def anchor(self, inputs: int, chars: int, ms: float) -> None:
        self._anchors.append((inputs, chars, ms))
        self._fit = self._slowest = None

    @property
    def anchors(self) -> list[tuple[int, int, float]]:
        """The warm-up's calls (another slot of the same backend adopts them)."""
        return list(self._anchors)

    def adopt(self, anchors: list[tuple[int, int, float]]) -> None:
        """Start from another slot's warm-up, as if this one had run it."""
        for anchor in anchors:
            self.anchor(*anchor)

    def took(self, inputs: int, chars: int, ms: float) -> None:
        self._recent.append((inputs, chars, ms))
        self._slowest = None
        self._unfitted += 1
        if len(self._recent) < RECENT_CALLS or self._unfitted >= REFIT_EVERY:
            self._fit = None

    @property
    def slowest_ms(self) -> float:
        """The slowest of the recent calls and the warm-up's (a call that
        ran long a while ago no longer stretches the hang timeout)."""
        if self._slowest is None:
            self._slowest = max((ms for *_, ms in (*self._anchors, *self._recent)), default=0.0)
        return self._slowest

    def predict_ms(self, inputs: int, chars: float) -> float:
        """The expected time of a call (0 before any was measured)."""
        a, b, c = self._fitted()
        return a + b * inputs + c * chars

    def full_batch_ms(self, max_batch: int) -> float:
        """A full batch of inputs as long as the recent ones (the anchors'
        before any real call)."""
        return self.predict_ms(max_batch, max_batch * self._chars_per_input())

    def one_input_ms(self) -> float:
        """A batch of one input as long as the recent ones: on a GPU about a
        full batch's time, on a CPU or an engine that serves each input
        apart, far less (admission counts a request's own batch by its size)."""
        return self.predict_ms(1, self._chars_per_input())

    def _chars_per_input(self) -> float:
        calls = self._recent or self._anchors
        inputs = sum(n for n, _, _ in calls)
        return sum(ch for _, ch, _ in calls) / inputs if inputs else DEFAULT_CHARS

    def hang_timeout_ms(self, inputs: int, chars: int) -> int:
        """How long this call may run: HANG_MULTIPLE times the longer of what
        it should take and the slowest call yet, and at least the floor."""
        expected = max(self.slowest_ms, self.predict_ms(inputs, chars))
        return max(self.hang_floor_ms, round(HANG_MULTIPLE * expected))

    def _fitted(self) -> tuple[float, float, float]:
        if self._fit is None:
            self._fit = fit([*self._anchors, *self._recent])
            self._unfitted = 0
        return self._fit


def fit(calls: list[tuple[int, int, float]]) -> tuple[float, float, float]:
    """Least squares of ``ms = a + b * inputs + c * chars``, in relative error
    (a call of 400 ms counts as much as one of 60 s), with every term at least
    0 (a term the calls cannot tell apart is left at 0, a slight ridge)."""
    if not calls:
        return 0.0, 0.0, 0.0
    weights = [1.0 / max(ms, 1e-3) for _, _, ms in calls]
    rows = [(w, w * n, w * ch) for (n, ch, _), w in zip(calls, weights, strict=True)]
    ys = [1.0] * len(calls)
    free = [0, 1, 2]
    while True:
        theta = _solve([[r[i] for i in free] for r in rows], ys)
        negative = [free[k] for k, v in enumerate(theta) if v < 0]
        if not negative:
            out = [0.0, 0.0, 0.0]
            for k, i in enumerate(free):
                out[i] = theta[k]
            return out[0], out[1], out[2]
        free = [i for i in free if i not in negative]
        if not free:
            return max(ms for _, _, ms in calls), 0.0, 0.0


def _solve(x: list[list[float]], y: list[float]) -> list[float]:
    """The normal equations, with a ridge of 1e-9 of each column's scale."""
    k = len(x[0])
    a = [[sum(r[i] * r[j] for r in x) for j in range(k)] for i in range(k)]
    b = [sum(r[i] * v for r, v in zip(x, y, strict=True)) for i in range(k)]
    for i in range(k):
        a[i][i] += 1e-9 * a[i][i] + 1e-12
    for col in range(k):  # Gaussian elimination with partial pivoting
        pivot = max(range(col, k), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        b[col], b[pivot] = b[pivot], b[col]
        for r in range(col + 1, k):
            f = a[r][col] / a[col][col]
            for c in range(col, k):
                a[r][c] -= f * a[col][c]
            b[r] -= f * b[col]
    out = [0.0] * k
    for r in reversed(range(k)):
        out[r] = (b[r] - sum(a[r][c] * out[c] for c in range(r + 1, k))) / a[r][r]
    return out
