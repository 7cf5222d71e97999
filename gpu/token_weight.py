"""What a new token costs against an input token, as the worker measures
it: a model reads a prompt's tokens together but writes its answer one
step at a time, so on a real model a new token costs several input
tokens' time (5 to 39 for SmolLM2-135M on CPU, docs/performance.md). A
call's share per request is split by input tokens plus new tokens times
this weight, fitted to the worker's own calls, ``us = a + b * input +
c * new`` by least squares over decaying sums; the weight is ``c / b``,
each drawn two standard errors toward a weight of one (calls of a few
tokens on a noisy machine made a weight of noise, up to the most).
Until the calls tell the two apart (inputs and answers of varied
lengths, time that follows them), a new token weighs one; once fitted,
the weight stays while later calls cannot tell them apart."""

import math

from infergate.base.wire import MOST_NEW_TOKEN_WEIGHT, held_weight

# Each call's weight in the sums decays by this per later call.
MEMORY = 0.995
# Calls whose inputs and answers grow together (their correlation's square
# over this) cannot tell the two apart.
MOST_CORRELATION = 0.95
# The tokens must explain at least this share of the calls' spread in time
# (a model whose time does not follow its tokens has no weight to fit).
LEAST_EXPLAINED = 0.5
# The weight is drawn this many standard errors toward one: the least
# slope per new token over the most per input token the calls allow.
ERRORS = 2.0
# A spread below this share of its sum of squares is rounding, not spread.
LEAST_SPREAD = 1e-9
# Calls before the weight is fitted at all, and between fits.
LEAST_CALLS = 16
REFIT_EVERY = 8


class NewTokenWeight:
    """The weight of a new token against an input token (``value``), fitted
    to the calls the worker ran, rounded to two decimals (it is sent with
    every answer)."""

    def __init__(self) -> None:
        # Decaying sums of 1, x, z, y, xx, xz, zz, xy, zy, yy (x: input
        # tokens, z: new tokens, y: the call's µs).
        self._sums = [0.0] * 10
        self._calls = 0
        self.value = 1.0

    def took(self, input_tokens: int, new_tokens: int, call_us: int) -> None:
        """A call that read ``input_tokens`` and wrote ``new_tokens`` in ``call_us``."""
        x, z, y = float(input_tokens), float(new_tokens), float(call_us)
        terms = (1.0, x, z, y, x * x, x * z, z * z, x * y, z * y, y * y)
        self._sums = [s * MEMORY + t for s, t in zip(self._sums, terms, strict=True)]
        self._calls += 1
        if self._calls >= LEAST_CALLS and self._calls % REFIT_EVERY == 0:
            weight = fitted(self._sums)
            if weight is not None:
                self.value = round(weight, 2)


def fitted(sums: list[float]) -> float | None:
    """``c / b`` of the least-squares fit, held to its bounds (a prefill
    measured as free: the most); None where the calls cannot tell a new
    token from an input token."""
    n, sx, sz, sy, sxx, sxz, szz, sxy, szy, syy = sums
    # (centred: the fixed part drops out of the slopes)
    vxx, vxz, vzz = sxx - sx * sx / n, sxz - sx * sz / n, szz - sz * sz / n
    vxy, vzy, vyy = sxy - sx * sy / n, szy - sz * sy / n, syy - sy * sy / n
    if min(vxx - LEAST_SPREAD * sxx, vzz - LEAST_SPREAD * szz, vyy - LEAST_SPREAD * syy) <= 0:
        return None  # (inputs, answers or times all of one size)
    spread = vxx * vzz - vxz * vxz
    if not spread > (1 - MOST_CORRELATION) * vxx * vzz:
        return None
    b = (vxy * vzz - vzy * vxz) / spread
    c = (vzy * vxx - vxy * vxz) / spread
    explained = b * vxy + c * vzy
    if not (c > 0 and explained >= LEAST_EXPLAINED * vyy):
        return None
    # (the slopes' errors: where a few tokens' time is lost in a call's
    # noise, the weight leans to one, not to whatever noise's ratio is)
    noise = max(vyy - explained, 0.0) / max(n - 3, 1.0)
    error_b, error_c = (math.sqrt(noise * v / spread) for v in (vzz, vxx))
    least_c, most_b = c - ERRORS * error_c, max(b, 0.0) + ERRORS * error_b
    if most_b <= 0:
        return MOST_NEW_TOKEN_WEIGHT  # (reading measured as free, exactly)
    weight = max(least_c, 0.0) / most_b
    return held_weight(weight) if math.isfinite(weight) else MOST_NEW_TOKEN_WEIGHT
