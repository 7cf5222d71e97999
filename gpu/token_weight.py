"""What a new token costs against an input token, as the worker measures
it: a model reads a prompt's tokens together but writes its answer one
step at a time, so on a real model a new token costs several input
tokens' time (5 to 39 for SmolLM2-135M on CPU, docs/performance.md). A
call's share per request is split by input tokens plus new tokens times
this weight, fitted to the worker's own calls, ``us = a + b * input +
c * new`` by least squares over decaying sums; the weight is ``c / b``.
Until the calls tell the two apart (inputs and answers of varied
lengths, time that follows them), a new token weighs one."""

# Each call's weight in the sums decays by this per later call.
MEMORY = 0.995
# The weight is held within these: writing a token costs at least reading it.
LEAST_WEIGHT = 1.0
MOST_WEIGHT = 64.0
# Calls whose inputs and answers grow together (their correlation's square
# over this) cannot tell the two apart.
MOST_CORRELATION = 0.95
# The tokens must explain at least this share of the calls' spread in time
# (a model whose time does not follow its tokens has no weight to fit).
LEAST_EXPLAINED = 0.5
# Calls before the weight is fitted at all, and between fits.
LEAST_CALLS = 16
REFIT_EVERY = 8


class NewTokenWeight:
    def __init__(self) -> None:
        # Decaying sums of 1, x, z, y, xx, xz, zz, xy, zy, yy (x: input
        # tokens, z: new tokens, y: the call's µs).
        self._sums = [0.0] * 10
        self._calls = 0
        self.weight = LEAST_WEIGHT

    def took(self, input_tokens: int, new_tokens: int, call_us: int) -> None:
        """A call that read ``input_tokens`` and wrote ``new_tokens`` in ``call_us``."""
        x, z, y = float(input_tokens), float(new_tokens), float(call_us)
        terms = (1.0, x, z, y, x * x, x * z, z * z, x * y, z * y, y * y)
        self._sums = [s * MEMORY + t for s, t in zip(self._sums, terms, strict=True)]
        self._calls += 1
        if self._calls >= LEAST_CALLS and self._calls % REFIT_EVERY == 0:
            self.weight = fitted(self._sums) or self.weight

    def weighed(self, input_tokens: int, new_tokens: int) -> int:
        """A request's tokens as input tokens' worth (one more: an empty one
        has a share of the call too)."""
        return 1 + input_tokens + round(self.weight * new_tokens)


def fitted(sums: list[float]) -> float | None:
    """``c / b`` of the least-squares fit, within its bounds; None where
    the calls cannot tell a new token from an input token."""
    n, sx, sz, sy, sxx, sxz, szz, sxy, szy, syy = sums
    # (centred: the fixed part drops out of the slopes)
    vxx, vxz, vzz = sxx - sx * sx / n, sxz - sx * sz / n, szz - sz * sz / n
    vxy, vzy, vyy = sxy - sx * sy / n, szy - sz * sy / n, syy - sy * sy / n
    spread = vxx * vzz - vxz * vxz
    if vxx <= 0 or vzz <= 0 or vyy <= 0 or spread <= (1 - MOST_CORRELATION) * vxx * vzz:
        return None
    b = (vxy * vzz - vzy * vxz) / spread
    c = (vzy * vxx - vxy * vxz) / spread
    if b <= 0 or c <= 0 or (b * vxy + c * vzy) < LEAST_EXPLAINED * vyy:
        return None
    return min(max(c / b, LEAST_WEIGHT), MOST_WEIGHT)
