"""What a new token costs against an input token, as the worker measures
it: a model reads a prompt's tokens together but writes its answer one
step at a time, and a batched engine runs each step for all its rows at
once, so a step costs about the same for one row as for eight (SmolLM2-135M
on CPU, docs/performance.md). The worker fits its own calls, ``us = a + b *
input + c * new + d * steps`` (``steps``: the longest answer's new tokens)
by least squares over decaying sums: a new token weighs ``c / b`` input
tokens, and each step ``d / b`` more, shared by the requests still writing
at it. Each slope is drawn two standard errors toward the least weight
(calls of a few tokens on a noisy machine made a weight of noise). Where
the calls cannot tell steps from new tokens (one row a call), the steps
are folded into the new tokens; where they cannot tell new tokens from
input (inputs and answers of one size, or growing together), a new token
weighs one, and once fitted the weights stay while later calls cannot. A
worker that starts beside others of its model, warmed up as fast as
they did, begins from the weights they fitted (``fleet_weights``, ``adopt``) for
its first calls, until its own fit (or none: then one)."""

import math

from infergate.base.wire import MOST_NEW_TOKEN_WEIGHT, Heartbeat, held_weight

# Each call's weight in the sums decays by this per later call.
MEMORY = 0.995
# A size the others explain this share of (its correlation's square with
# them) cannot be told apart from them.
MOST_CORRELATION = 0.95
# The tokens must explain at least this share of the calls' spread in time
# (a model whose time does not follow its tokens has no weight to fit).
LEAST_EXPLAINED = 0.5
# Each weight is drawn this many standard errors toward the least: the
# least slope per new token (and per step) over the most per input token.
ERRORS = 2.0
# A spread below this share of its sum of squares is rounding, not spread.
LEAST_SPREAD = 1e-9
# Calls before the weight is fitted at all, and between fits.
LEAST_CALLS = 16
REFIT_EVERY = 8
# The sums' terms: a call's 1, input tokens, new tokens, steps and µs.
ONE, INPUT, NEW, STEPS, US = range(5)
# A worker whose warm-up took within this factor of another's runs its
# model as fast: its tokens cost alike (one on another device does not).
AS_FAST = 1.5


class TokenWeights:
    """A new token's weight against an input token (``per_token``) and a
    decoding step's, shared by the requests writing at it (``per_step``),
    fitted to the calls the worker ran, each rounded to two decimals; a
    new token written alone weighs their sum (``alone``, sent with every
    answer: the most a request's new token weighs)."""

    def __init__(self) -> None:
        # Decaying sums of each term's product with each (5 x 5, symmetric).
        self._sums = [[0.0] * 5 for _ in range(5)]
        self._calls = 0
        self.per_token = 1.0
        self.per_step = 0.0
        self.fitted = False  # (by its own calls: what its heartbeat says)
        self.adopted = False  # (another worker's, until its own first fit)

    @property
    def alone(self) -> float:
        """A new token's weight written alone (its every step its own)."""
        return min(round(self.per_token + self.per_step, 2), MOST_NEW_TOKEN_WEIGHT)

    def took(
        self, input_tokens: int, new_tokens: int, call_us: int, steps: int | None = None
    ) -> None:
        """A call that read ``input_tokens`` and wrote ``new_tokens`` in
        ``call_us``, in ``steps`` decoding steps (its longest answer's new
        tokens; by default a call of one row, whose steps are its tokens)."""
        steps = new_tokens if steps is None else steps
        terms = tuple(map(float, (1, input_tokens, new_tokens, steps, call_us)))
        for row, t in zip(self._sums, terms, strict=True):
            for j, u in enumerate(terms):
                row[j] = row[j] * MEMORY + t * u
        self._calls += 1
        if self._calls >= LEAST_CALLS and self._calls % REFIT_EVERY == 0:
            weights = fitted(self._sums)
            if weights is not None:
                self.per_token, self.per_step = (round(w, 2) for w in weights)
                self.fitted = True
            elif self.adopted:  # (its own calls cannot tell: as a worker alone)
                self.per_token, self.per_step = 1.0, 0.0
            self.adopted = False

    def said(self) -> list[float]:
        """The weights for the heartbeat: none before its own first fit."""
        return [self.per_token, self.per_step] if self.fitted else []

    def adopt(self, weights: list[float]) -> bool:
        """Begin from the weights other workers of the model fitted (their
        heartbeats': ``fleet_weights``), held as a fit holds them, for the
        calls before its own first fit; False for weights that mean nothing
        (as a planted beat's may)."""
        if self.fitted or len(weights) != 2 or not all(map(math.isfinite, weights)):
            return False
        per_token, per_step = held(*weights)
        self.per_token, self.per_step = round(per_token, 2), round(per_step, 2)
        self.adopted = True
        return True


def fleet_weights(beats: list[Heartbeat], model: str, warm_ms: float) -> list[float]:
    """The weights to begin from: the median, by a new token's weight
    alone, of those fitted by the workers of ``model`` (its fingerprint)
    that take work and warmed up about as fast as this one's ``warm_ms``
    (within ``AS_FAST``: the same device's costs); none if no worker is such."""
    if warm_ms <= 0:
        return []
    alike = [
        w.token_weights
        for w in beats
        if w.model == model
        and not w.draining
        and len(w.token_weights) == 2
        and warm_ms / AS_FAST <= w.warm_ms <= warm_ms * AS_FAST
    ]
    if not alike:
        return []
    alike.sort(key=lambda weights: weights[0] + weights[1])
    return alike[(len(alike) - 1) // 2]


def fitted(sums: list[list[float]]) -> tuple[float, float] | None:
    """A new token's weight and a step's, held so that a new token alone
    weighs 1-64 (a prefill measured as free: the most); None where the
    calls cannot tell a new token from an input token."""
    n = sums[ONE][ONE]
    # (centred: the fixed part drops out of the slopes)
    centred = [[sums[i][j] - sums[ONE][i] * sums[ONE][j] / n for j in range(5)] for i in range(5)]
    if any(centred[t][t] <= LEAST_SPREAD * sums[t][t] for t in (INPUT, NEW, US)):
        return None  # (inputs, answers or times all of one size)
    steps_vary = centred[STEPS][STEPS] > LEAST_SPREAD * sums[STEPS][STEPS]
    for terms in ((INPUT, NEW, STEPS), (INPUT, NEW)) if steps_vary else ((INPUT, NEW),):
        # (where the calls cannot tell steps from new tokens, they are folded in)
        slopes = _slopes(centred, terms, n)
        if slopes is not None:
            return _weights(*slopes)
    return None


def _slopes(
    centred: list[list[float]], terms: tuple[int, ...], n: float
) -> tuple[list[float], list[float]] | None:
    """The least-squares slopes of the call's µs on ``terms`` and their
    standard errors; None where a term is one the others explain, or the
    terms do not explain the calls' times."""
    inverse = _inverse([[centred[i][j] for j in terms] for i in terms])
    if inverse is None:
        return None
    if any(
        centred[t][t] * inverse[k][k] >= 1 / (1 - MOST_CORRELATION) for k, t in enumerate(terms)
    ):
        return None  # (its correlation with the others' over the most)
    toward_us = [centred[t][US] for t in terms]
    slopes = [sum(row[j] * toward_us[j] for j in range(len(terms))) for row in inverse]
    explained = sum(s * v for s, v in zip(slopes, toward_us, strict=True))
    if not (sum(slopes[1:]) > 0 and explained >= LEAST_EXPLAINED * centred[US][US]):
        return None
    # (where a few tokens' time is lost in a call's noise, each weight
    # leans to the least, not to whatever noise's ratio is)
    noise = max(centred[US][US] - explained, 0.0) / max(n - len(terms) - 1, 1.0)
    errors = [math.sqrt(noise * max(inverse[k][k], 0.0)) for k in range(len(terms))]
    return slopes, errors


def _weights(slopes: list[float], errors: list[float]) -> tuple[float, float]:
    """Each slope past the input token's, drawn ``ERRORS`` standard errors
    toward the least, over the input token's drawn toward the most; where
    a new token alone would weigh over the most (or reading is measured as
    free), both scaled down alike: their ratio is what splits a call."""
    most_input = max(slopes[0], 0.0) + ERRORS * errors[0]
    least = [max(s - ERRORS * e, 0.0) for s, e in zip(slopes[1:], errors[1:], strict=True)]
    per_token, per_step = least[0], (least[1] if len(least) > 1 else 0.0)
    if not math.isfinite(per_token + per_step):
        return MOST_NEW_TOKEN_WEIGHT, 0.0
    if per_token + per_step <= 0:  # (writing measured as free: reading, as free, is the most)
        return (1.0 if most_input > 0 else MOST_NEW_TOKEN_WEIGHT), 0.0
    if most_input > 0:
        per_token, per_step = per_token / most_input, per_step / most_input
    alone = per_token + per_step
    if most_input <= 0 or alone > MOST_NEW_TOKEN_WEIGHT:
        scale = MOST_NEW_TOKEN_WEIGHT / alone
        per_token, per_step = per_token * scale, per_step * scale
    return held(per_token, per_step)


def held(per_token: float, per_step: float) -> tuple[float, float]:
    """A new token's weight held to 1-64, and a step's to what leaves a
    new token alone at 64 at most (nothing below none)."""
    per_token = held_weight(per_token)
    return per_token, min(max(per_step, 0.0), MOST_NEW_TOKEN_WEIGHT - per_token)


def _inverse(matrix: list[list[float]]) -> list[list[float]] | None:
    """A small symmetric matrix's inverse (Gauss-Jordan), None if singular."""
    size = len(matrix)
    rows = [[*row, *(float(i == j) for j in range(size))] for i, row in enumerate(matrix)]
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(rows[r][col]))
        if not abs(rows[pivot][col]) > LEAST_SPREAD * max(abs(matrix[col][col]), 1e-300):
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        scale = rows[col][col]
        rows[col] = [v / scale for v in rows[col]]
        for r in range(size):
            if r != col and rows[r][col]:
                factor = rows[r][col]
                rows[r] = [v - factor * p for v, p in zip(rows[r], rows[col], strict=True)]
    return [row[size:] for row in rows]
