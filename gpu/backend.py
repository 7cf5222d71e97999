"""The backend contract every worker runs against.

def infer(inputs: list[str]) -> list[str]
# 1-100 inputs, one output per input, ~one batch time per call whatever
# the batch size, and ONE call at a time per instance.
"""

import re
import threading
from collections.abc import Hashable
from typing import Protocol

MAX_BATCH = 100


class BackendError(Exception):
    """The backend failed on this call; the worker isolates the bad input(s)."""


class ContractError(BackendError):
    """The call broke the contract (batch size, concurrency)."""


class Backend(Protocol):
    name: str
    # Whatever decides the outputs (backend, model, generation settings):
    # cached answers are kept per fingerprint, so a new model never serves
    # the old one's.
    fingerprint: str

    def infer(self, inputs: list[str]) -> list[str]: ...

    # The same call with a temperature per input (0: greedy), and the
    # backend's own tokens: an output cut to a request's max_tokens, and its
    # length in them.
    def infer_sampled(self, inputs: list[str], temperatures: list[float]) -> list[str]: ...

    def clip(self, text: str, max_tokens: int) -> tuple[str, int]: ...


class Prompts(list[str]):
    """The inputs of one backend call, with the slot each one fills (``keys``:
    identical greedy inputs share one), when any is sampled each one's
    temperature, and the index of the highest tier among them (``rank``: a
    worker serving several shards runs the best-ranked waiting call first,
    ``gate.py``). A slice keeps them."""

    def __init__(
        self,
        inputs: list[str],
        keys: list[Hashable],
        temperatures: list[float] | None = None,
        rank: int = 0,
    ) -> None:
        super().__init__(inputs)
        self.keys = keys
        self.temperatures = temperatures
        self.rank = rank

    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        if not isinstance(i, slice):
            return list.__getitem__(self, i)
        temperatures = None if self.temperatures is None else self.temperatures[i]
        return Prompts(list.__getitem__(self, i), self.keys[i], temperatures, self.rank)


def run(backend: Backend, inputs: list[str]) -> list[str]:
    """One call of the backend: sampled when any of its inputs asks to be."""
    temperatures = getattr(inputs, "temperatures", None)
    if temperatures is None:
        return backend.infer(inputs)
    return backend.infer_sampled(inputs, temperatures)


def slot_keys(inputs: list[str]) -> list[Hashable]:
    """The slot each input of a call fills (itself, for a plain list)."""
    keys: list[Hashable] = getattr(inputs, "keys", inputs)
    return keys


WORD = re.compile(r"\S+")


def clip_words(text: str, max_tokens: int) -> tuple[str, int]:
    """``text`` cut after its first ``max_tokens`` words (0: uncut), and its
    words: the tokens of a backend without a tokenizer."""
    if max_tokens <= 0:
        return text, len(text.split())
    count = 0
    for match in WORD.finditer(text):
        count += 1
        if count == max_tokens:
            return text[: match.end()], count
    return text, count


def check_batch(inputs: list[str]) -> None:
    if not 1 <= len(inputs) <= MAX_BATCH:
        raise ContractError(f"a batch holds 1-{MAX_BATCH} inputs, got {len(inputs)}")


class OneAtATime:
    """The contract's 'one batch at a time per GPU': a second concurrent call
    raises instead of queueing behind the first."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            raise ContractError("the backend runs one batch at a time")

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
