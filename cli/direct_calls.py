"""The model servers a gateway calls itself in direct mode
(``gateway/direct.py``): a model whose backend is a server (``http:``,
``kserve-v2:``, ``openai:``) gets the same backend a worker would make, its
outputs cut and counted as a worker's are. A backend that runs in a
worker's process (simulated, transformers, python) has none: its requests
fail fast while Redis is away."""

import argparse
from typing import TYPE_CHECKING

from infergate.policies.schema import Model
from infergate.serving import build, checked_spec

if TYPE_CHECKING:
    from infergate.gateway.direct import DirectCall

REMOTE_KINDS = ("http", "kserve-v2", "openai")


def direct_call(name: str, model: Model) -> "DirectCall | None":
    """The call of ``model``'s server, or None where it has none a gateway
    can reach (or its spec cannot work: the workers say why)."""
    from infergate.gpu.backend import Counted, Prompts, Unusable, run

    try:
        spec = checked_spec(model.backend, model.options)
        if spec.kind not in REMOTE_KINDS:
            return None
        backend = build(argparse.Namespace(max_new_tokens=None), model, spec, model.options)
    except (Unusable, ValueError):
        return None

    def call(inputs: list[str], max_tokens: list[int], deadline_ms: int) -> list[tuple[str, int]]:
        prompts = Prompts(
            inputs,
            list(range(len(inputs))),
            max_tokens=max_tokens if any(max_tokens) else None,
            deadline_ms=deadline_ms,
        )
        outputs = run(backend, prompts)
        if not isinstance(outputs, list) or len(outputs) != len(inputs):
            raise ValueError("the server's answer is not one output per input")
        answered = []
        for output, limit in zip(outputs, max_tokens, strict=True):
            if not isinstance(output, str):
                raise ValueError("the server's output is not a string")
            if isinstance(output, Counted) and output.tokens > 0:
                answered.append((str(output), output.tokens))
            else:
                answered.append(backend.clip(output, limit))
        return answered

    return call
