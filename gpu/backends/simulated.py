"""The simulated backend, exact to the contract: 1-100 inputs or it raises,
one output per input, ``latency_ms`` per call whatever the batch size, and
one call at a time (a second concurrent call raises).

Its output for ``s`` is ``sim_output(s)``, which contains ``s``, so anyone
can see that each reply belongs to its request. Sampled at a temperature
above 0, the output also carries a random draw, as a sampling model's
differs from call to call. Its tokens are words, and it stops at each
input's ``max_tokens`` of them; with ``ms_per_ktoken``, a call's time
grows with the tokens it reads and writes, as a real model's does with
its own (a model whose time follows anything else cannot be metered by
its tokens: ``gateway/costs.py``), a new token ``new_token_weight`` times
an input token's (a real model writes its answer a step at a time), and
each decoding step ``step_weight`` input tokens' more for the whole batch
(its longest answer's words: a batched engine runs a step for all its
rows at once). To test failure handling,
any input containing ``fail_marker`` makes the whole call raise, as a
poisoned input does on a real model, and any input containing
``hang_marker`` makes the call hang for ``hang_s`` (a stuck GPU). Both are
off unless given (``infergate worker --sim-fail-marker __fail__``): in a
running stack they would let any key fail or hang a worker at will.
"""

import os
import time
import zlib

from infergate.gpu.backend import (
    BackendError,
    OneAtATime,
    Upstream,
    check_batch,
    clip_words,
    max_tokens_of,
)


def sim_output(s: str, temperature: float = 0.0, model: str = "") -> str:
    """What the simulated model answers (a model other than ``default`` names itself)."""
    head = f"sim{'/' + model if model else ''}[{zlib.crc32(s.encode('utf-8')):08x}]"
    if temperature > 0:
        head += f"~{temperature:g}:{os.urandom(4).hex()}"
    return f"{head}: {s}"


class SimulatedBackend:
    name = "simulated"
    lacks: frozenset[str] = frozenset()  # (it samples, and clips to max_tokens)
    upstream: Upstream | None = None

    def __init__(
        self,
        latency_ms: float = 100.0,
        fail_marker: str | None = None,
        hang_marker: str | None = None,
        hang_s: float = 3600.0,
        model: str = "",
        ms_per_ktoken: float = 0.0,
        new_token_weight: float = 1.0,
        step_weight: float = 0.0,
    ) -> None:
        self.model = model
        # Its output depends on the input alone (and the model it names).
        self.fingerprint = "simulated/1" + (f"/{model}" if model else "")
        if latency_ms < 0 or not 0 <= ms_per_ktoken <= 60_000:
            raise ValueError("latency_ms must be >= 0, ms_per_ktoken 0-60000")
        if not 1 <= new_token_weight <= 1000:
            raise ValueError("new_token_weight must be 1-1000")
        if not 0 <= step_weight <= 1000:
            raise ValueError("step_weight must be 0-1000")
        self.latency_s = latency_ms / 1000.0
        # A batch's time grows with what it reads and writes (a model's
        # prefill and decode): per token in and out, on top.
        self.s_per_token = ms_per_ktoken / 1e6
        self.new_token_weight = new_token_weight
        self.step_weight = step_weight
        self.fail_marker = fail_marker or None
        self.hang_marker = hang_marker or None
        self.hang_s = hang_s
        self._one_at_a_time = OneAtATime()

    def infer(self, inputs: list[str]) -> list[str]:
        return self.infer_sampled(inputs, [0.0] * len(inputs))

    def clip(self, text: str, max_tokens: int) -> tuple[str, int]:
        return clip_words(text, max_tokens)

    def _output(self, s: str, temperature: float, most: int) -> str:
        """``sim_output``, stopped at ``most`` words (0: none)."""
        output = sim_output(s, temperature, self.model)
        return clip_words(output, most)[0] if most > 0 else output

    def _token_s(self, inputs: list[str], outputs: list[str]) -> float:
        """A call's time for the tokens it reads and writes."""
        if not self.s_per_token:
            return 0.0
        read = sum(len(s.split()) for s in inputs)
        wrote = [len(s.split()) for s in outputs]
        steps = max(wrote, default=0)
        return (
            read + self.new_token_weight * sum(wrote) + self.step_weight * steps
        ) * self.s_per_token

    def infer_sampled(self, inputs: list[str], temperatures: list[float]) -> list[str]:
        check_batch(inputs)
        with self._one_at_a_time:
            rows = zip(inputs, temperatures, max_tokens_of(inputs), strict=True)
            outputs = [self._output(s, t, most) for s, t, most in rows]
            time.sleep(self.latency_s + self._token_s(inputs, outputs))
            if self.hang_marker is not None and any(self.hang_marker in s for s in inputs):
                time.sleep(self.hang_s)
            if self.fail_marker is not None and any(self.fail_marker in s for s in inputs):
                raise BackendError("simulated failure: input contains the fail marker")
            return outputs
