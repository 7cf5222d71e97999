"""The backend contract every worker runs against.

def infer(inputs: list[str]) -> list[str]
# 1-100 inputs, one output per input, ~one batch time per call whatever
# the batch size, and ONE call at a time per instance.
"""

import threading
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
