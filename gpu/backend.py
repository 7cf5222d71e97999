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


class Unusable(Exception):
    """The backend cannot serve at all (its code, its options, what its
    server says it serves): what to fix, in one line. A worker that meets
    it before joining the fleet exits 2."""


class UpstreamError(BackendError):
    """The server a remote backend calls did not answer (down, overloaded,
    refusing its credentials): no input is at fault, so the batch is not
    split; its requests are answered 503, to be retried."""


class Partial(BackendError):
    """A call whose inputs were answered apart (an engine that takes each
    prompt on its own), some failing alone: each input's output or error,
    in order. The worker keeps them as they are, with no split."""

    def __init__(self, outcomes: "list[str | BackendError]") -> None:
        failed = next(o for o in outcomes if isinstance(o, BackendError))
        super().__init__(
            f"{sum(isinstance(o, BackendError) for o in outcomes)} inputs failed: {failed}"
        )
        self.outcomes = outcomes


def unanswered(exc: BackendError) -> bool:
    """The call failed only because its server did not answer (no input at fault)."""
    if isinstance(exc, Partial):
        failed = [o for o in exc.outcomes if isinstance(o, BackendError)]
        return all(isinstance(o, UpstreamError) for o in failed)
    return isinstance(exc, UpstreamError)


class Upstream(Protocol):
    """The server behind a remote backend, as the worker watches it."""

    # False from a call it could not answer until one it answers (or a probe).
    healthy: bool
    # The longest a call to it may take, retries included (the worker's
    # hang timeout stays above it).
    timeout_ms: int

    def probe(self) -> bool:
        """Whether the server answers now (a cheap request; blocking)."""
        ...

    def close(self) -> None:
        """Close its connections (blocking)."""
        ...


class Backend(Protocol):
    name: str
    # Whatever decides the outputs (backend, model, generation settings):
    # cached answers are kept per fingerprint, so a new model never serves
    # the old one's.
    fingerprint: str
    # What it cannot do for a request (``policies.backends``: SAMPLING,
    # MAX_TOKENS): the gateway refuses those while every worker lacks them.
    lacks: frozenset[str]
    # The server it calls, for a remote backend (None in the worker's process).
    upstream: Upstream | None

    def infer(self, inputs: list[str]) -> list[str]: ...

    # The same call with a temperature per input (0: greedy), and the
    # backend's own tokens: an output cut to a request's max_tokens, and its
    # length in them.
    def infer_sampled(self, inputs: list[str], temperatures: list[float]) -> list[str]: ...

    def clip(self, text: str, max_tokens: int) -> tuple[str, int]: ...


class Prompts(list[str]):
    """The inputs of one backend call, with the slot each one fills (``keys``:
    identical greedy inputs share one), when any is sampled each one's
    temperature, when any asks for fewer tokens each one's ``max_tokens``
    (0: the model's bound), the index of the highest tier among them
    (``rank``: a worker serving several shards runs the best-ranked waiting
    call first, ``gate.py``), the latest deadline among their requests
    (``deadline_ms``, epoch ms; 0: none; a remote backend retries within
    it), and where any is a chat's, each one's messages (``conversations``,
    JSON; a backend with a chat template of its own renders them). A slice
    keeps them."""

    def __init__(
        self,
        inputs: list[str],
        keys: list[Hashable],
        temperatures: list[float] | None = None,
        rank: int = 0,
        max_tokens: list[int] | None = None,
        deadline_ms: int = 0,
        conversations: list[str | None] | None = None,
    ) -> None:
        super().__init__(inputs)
        self.keys = keys
        self.temperatures = temperatures
        self.rank = rank
        self.max_tokens = max_tokens
        self.deadline_ms = deadline_ms
        self.conversations = conversations

    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        if not isinstance(i, slice):
            return list.__getitem__(self, i)
        temperatures = None if self.temperatures is None else self.temperatures[i]
        max_tokens = None if self.max_tokens is None else self.max_tokens[i]
        conversations = None if self.conversations is None else self.conversations[i]
        return Prompts(
            list.__getitem__(self, i),
            self.keys[i],
            temperatures,
            self.rank,
            max_tokens,
            self.deadline_ms,
            conversations,
        )


def max_tokens_of(inputs: list[str]) -> list[int]:
    """Each input's ``max_tokens`` (0: the model's bound), for a call's inputs."""
    given: list[int] | None = getattr(inputs, "max_tokens", None)
    return given if given is not None else [0] * len(inputs)


def conversations_of(inputs: list[str]) -> list[str | None]:
    """Each input's chat messages as JSON, where it is a chat's (None: not)."""
    given: list[str | None] | None = getattr(inputs, "conversations", None)
    return given if given is not None else [None] * len(inputs)


def deadline_of(inputs: list[str]) -> int:
    """The latest deadline among a call's requests (epoch ms; 0: none known)."""
    deadline: int = getattr(inputs, "deadline_ms", 0)
    return deadline


class Counted(str):
    """An output with its tokens as the engine that made it counted them
    (and its input's): usage reports these, and no clip is needed (the
    engine stopped at the request's ``max_tokens`` itself)."""

    tokens: int
    input_tokens: int

    def __new__(cls, text: str, tokens: int, input_tokens: int = 0) -> "Counted":
        out = super().__new__(cls, text)
        out.tokens = tokens
        out.input_tokens = input_tokens
        return out


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
