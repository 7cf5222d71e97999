"""A team's own model, as a user would write one, for the ``python:``
backend's tests: a batch function, an async one, and a class built with
the policy's options, and a model whose answers may be long (``talker``).
Markers in an input break the contract on purpose:
``__raise__`` raises, ``__count__`` answers one output too few,
``__type__`` answers a number, ``__hang__`` never returns."""

import asyncio
import time


def _check(inputs: list[str]) -> None:
    if any("__raise__" in s for s in inputs):
        raise RuntimeError("the model cannot read this input")
    if any("__hang__" in s for s in inputs):
        time.sleep(3600)


def batchstring(inputs: list[str]) -> list[str]:
    """The design documents' function: one output per input."""
    _check(inputs)
    time.sleep(0.02)
    outputs: list = [f"fn:{s}" for s in inputs]
    if any("__count__" in s for s in inputs):
        outputs.pop()
    if any("__type__" in s for s in inputs):
        outputs[0] = 42
    return outputs


def talker(inputs: list[str]) -> list[str]:
    """A model whose answers may be long: "say N ..." answers N words (any
    other input, its own words), and a call takes 0.5 ms for each word it
    reads and writes, as a model's prefill and decode do, and 10 ms more."""
    _check(inputs)
    outputs = []
    for s in inputs:
        words = s.split()
        asked = len(words) > 1 and words[0] == "say" and words[1].isdigit()
        outputs.append(" ".join(["word"] * min(int(words[1]), 1000)) if asked else s)
    time.sleep(0.01 + 0.0005 * sum(len(s.split()) for s in inputs + outputs))
    return outputs


async def abatch(inputs: list[str]) -> list[str]:
    _check(inputs)
    await asyncio.sleep(0.02)
    return [f"async:{s}" for s in inputs]


class Reverser:
    """Built once per worker with the model's options; samples and counts
    its own tokens (characters, to tell them from the default's words)."""

    def __init__(self, prefix: str = "rev", delay_ms: float = 20) -> None:
        self.prefix = prefix
        self.delay_s = delay_ms / 1000
        self.fingerprint = f"reverser/{prefix}"

    def infer(self, inputs: list[str]) -> list[str]:
        _check(inputs)
        time.sleep(self.delay_s)
        return [f"{self.prefix}:{s[::-1]}" for s in inputs]

    def infer_sampled(self, inputs: list[str], temperatures: list[float]) -> list[str]:
        outputs = self.infer(inputs)
        return [f"{o}~{t:g}" if t else o for o, t in zip(outputs, temperatures, strict=True)]

    def clip(self, text: str, max_tokens: int) -> tuple[str, int]:
        if max_tokens and len(text) > max_tokens:
            text = text[:max_tokens]
        return text, len(text)


def needs_two(a: list[str], b: list[str]) -> list[str]:
    return a


def make_reverser(prefix: str = "made") -> Reverser:
    """A factory: its parameters are all keywords."""
    return Reverser(prefix)


def drops_one_of_many(inputs: list[str]) -> list[str]:
    """Keeps the contract for small batches, breaks it from 50 inputs on."""
    outputs = [f"fn:{s}" for s in inputs]
    return outputs[:-1] if len(outputs) >= 50 else outputs


class SlowToLoad:
    """Loads its weights for ``load_s`` (a real model on a CPU takes a minute)."""

    def __init__(self, load_s: float = 4.0) -> None:
        time.sleep(load_s)

    def infer(self, inputs: list[str]) -> list[str]:
        return [f"loaded:{s}" for s in inputs]
