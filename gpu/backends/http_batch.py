"""``http:URL``: a server that takes the whole batch in one JSON call, the
design documents' GPU worker API, in a contract small enough to put in
front of any model in an hour (docs/backends.md):

    POST URL  {"inputs": ["...", ...],
               "parameters": {"temperature": [...], "max_tokens": [...]}}   (when any is set)
    200       {"outputs": ["...", ...],                  one string per input, in order
               "tokens": [...], "input_tokens": [...]}   (optional: its own counts)

A 400 (or another 4xx, or a 500 twice) refuses the batch: the worker
splits it to find the input at fault. 429, 502-504, 401/403/404/408 (or no
answer) say the server is unavailable: tried again within the batch's
deadline (``remote.py``). The options say what it honours (``sampling``,
``max_tokens``: refused at the gateway otherwise) and where its health is
(``health_path``; otherwise any answer from its address will do).
"""

import urllib.parse
from typing import Any

from infergate.gpu.backend import (
    BackendError,
    Counted,
    Upstream,
    check_batch,
    clip_words,
    max_tokens_of,
)
from infergate.gpu.backends.remote import Remote
from infergate.policies.backends import MAX_TOKENS, SAMPLING


class HttpBatchBackend:
    name = "http"

    def __init__(self, url: str, options: dict[str, Any]) -> None:
        path = options.get("health_path")
        health = urllib.parse.urljoin(url, path) if path else None
        self.remote = Remote(url, options, health)
        self.upstream: Upstream | None = self.remote
        lacks = set()
        if not options.get("sampling"):
            lacks.add(SAMPLING)
        if not options.get("max_tokens"):
            lacks.add(MAX_TOKENS)
        self.lacks: frozenset[str] = frozenset(lacks)
        self.fingerprint = f"http/{url}"

    def infer(self, inputs: list[str]) -> list[str]:
        return self._call(inputs, None)

    def infer_sampled(self, inputs: list[str], temperatures: list[float]) -> list[str]:
        return self._call(inputs, temperatures)

    def clip(self, text: str, max_tokens: int) -> tuple[str, int]:
        """(Outputs the server counted come as ``Counted``; others count words.)"""
        return clip_words(text, max_tokens if MAX_TOKENS in self.lacks else 0)

    def _call(self, inputs: list[str], temperatures: list[float] | None) -> list[str]:
        check_batch(inputs)
        body: dict[str, Any] = {"inputs": list(inputs)}
        parameters: dict[str, list[Any]] = {}
        if temperatures is not None and any(temperatures):
            parameters["temperature"] = list(temperatures)
        max_tokens = max_tokens_of(inputs)
        if any(max_tokens):
            parameters["max_tokens"] = max_tokens
        if parameters:
            body["parameters"] = parameters
        url = self.remote.url

        async def attempt(timeout_s: float) -> Any:
            return await self.remote.post(url, body, timeout_s)

        return outputs_of(self.remote.call(inputs, attempt), len(inputs))


def outputs_of(answer: Any, count: int) -> list[str]:
    """The outputs of an answer to the contract (BackendError for one that
    breaks it), counted where the server counted them."""
    outputs = answer.get("outputs") if isinstance(answer, dict) else None
    if not isinstance(outputs, list):
        raise BackendError('the server\'s answer has no "outputs" list')
    if len(outputs) != count:
        raise BackendError(f"the server returned {len(outputs)} outputs for {count} inputs")
    for i, out in enumerate(outputs):
        if not isinstance(out, str):
            raise BackendError(f"output {i} is {type(out).__name__}, not a string")
    tokens, input_tokens = _counts(answer, "tokens", count), _counts(answer, "input_tokens", count)
    if tokens is None:
        return outputs
    return [
        Counted(out, n, input_tokens[i] if input_tokens else 0)
        for i, (out, n) in enumerate(zip(outputs, tokens, strict=True))
    ]


def _counts(answer: dict[str, Any], name: str, count: int) -> list[int] | None:
    given = answer.get(name)
    if given is None:
        return None
    if (
        not isinstance(given, list)
        or len(given) != count
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in given)
    ):
        raise BackendError(f'the server\'s "{name}" must be a count per input')
    return given
