"""The backend contract every worker runs against.

def infer(inputs: list[str]) -> list[str]
# 1-100 inputs, one output per input, ~one batch time per call whatever
# the batch size, and ONE call at a time per instance.
"""

from typing import Protocol

MAX_BATCH = 100


class BackendError(Exception):
    """The backend failed on this call; the worker isolates the bad input(s)."""


class ContractError(BackendError):
    """The call broke the contract (batch size, concurrency)."""


class Backend(Protocol):
    name: str

    def infer(self, inputs: list[str]) -> list[str]: ...


def check_batch(inputs: list[str]) -> None:
    if not 1 <= len(inputs) <= MAX_BATCH:
        raise ContractError(f"a batch holds 1-{MAX_BATCH} inputs, got {len(inputs)}")
