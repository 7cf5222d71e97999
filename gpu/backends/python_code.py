"""The team's own code as the backend, ``python:pkg.module:attr``, imported
once as the worker starts (never from a live policy edit: SECURITY.md).

``attr`` is a batch function ``(inputs: list[str]) -> list[str]`` (or an
``async def`` of that shape); or a class, or a factory (a function whose
parameters all have defaults or are keywords), built once with the model's
``options`` as keyword arguments, whose instance has ``infer(inputs)`` (or
an async one) and, if it can, ``infer_sampled(inputs, temperatures)``,
``clip(text, max_tokens) -> (text, tokens)`` and ``count_tokens(text)``;
or an object that has ``infer`` already. What it lacks (sampling without
``infer_sampled``, ``max_tokens`` without ``clip``) the gateway refuses
with 400. An import error, a missing attribute or a wrong signature is
``Unusable``: one line, exit 2, before the worker joins the fleet. At run
time whatever the code does (raises, answers a count or a type the
contract does not allow) is a ``BackendError`` for that call, which the
worker splits down to the inputs at fault; never the worker's end.
"""

import importlib
import inspect
import sys
from collections.abc import Callable
from typing import Any

from infergate.gpu.backend import (
    BackendError,
    Unusable,
    Upstream,
    check_batch,
    clip_words,
)
from infergate.gpu.backends.remote import LoopThread
from infergate.policies.backends import MAX_TOKENS, SAMPLING


def _load(target: str) -> Any:
    module_name, _, attr = target.partition(":")
    if module_name not in sys.modules and "" not in sys.path:
        sys.path.insert(0, "")  # (the directory it was started in, as `python -m` has it)
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # (whatever importing its code raises)
        raise Unusable(f"cannot import {module_name}: {type(exc).__name__}: {exc}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise Unusable(f"{module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def _positional(fn: Callable[..., Any]) -> tuple[int, int] | None:
    """How many positional arguments ``fn`` requires and accepts (None if
    its signature cannot be read)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        required = sum(p.kind in kinds and p.default is p.empty for p in params)
        return required, 1_000
    positional = [p for p in params if p.kind in kinds]
    return sum(p.default is p.empty for p in positional), len(positional)


def _takes(fn: Callable[..., Any], n: int) -> bool:
    shape = _positional(fn)
    return shape is None or shape[0] <= n <= shape[1]


def _method(obj: Any, name: str, n: int, where: str) -> Callable[..., Any] | None:
    method = getattr(obj, name, None)
    if method is None:
        return None
    if not callable(method) or not _takes(method, n):
        raise Unusable(f"{where}.{name} must take {n} argument{'s' * (n > 1)}")
    return method  # type: ignore[no-any-return]


class PythonBackend:
    """Runs the team's code to the contract (``gpu/backend.py``)."""

    name = "python"
    upstream: Upstream | None = None

    def __init__(self, target: str, options: dict[str, Any]) -> None:
        obj = _load(target)
        self._loop = LoopThread("backend-async")
        instance = self._build(obj, target, options)
        self._infer: Callable[..., Any]
        if instance is None:  # a batch function
            self._infer, self._sampled, self._clip, self._count = obj, None, None, None
            owner: Any = obj
        else:
            infer = _method(instance, "infer", 1, target)
            if infer is None:
                raise Unusable(f"{target} built an object without infer(inputs)")
            self._infer = infer
            self._sampled = _method(instance, "infer_sampled", 2, target)
            self._clip = _method(instance, "clip", 2, target)
            self._count = _method(instance, "count_tokens", 1, target)
            owner = instance
        lacks = {SAMPLING} if self._sampled is None else set()
        if self._clip is None:
            lacks.add(MAX_TOKENS)
        self.lacks = frozenset(lacks)
        given = getattr(owner, "fingerprint", None)
        self.fingerprint = given if isinstance(given, str) and given else f"python/{target}"

    def _build(self, obj: Any, target: str, options: dict[str, Any]) -> Any:
        """The instance to call (None: ``obj`` is the batch function itself)."""
        if inspect.isclass(obj):
            return _construct(obj, target, options)
        if not inspect.isroutine(obj) and hasattr(obj, "infer"):  # an object built already
            if options:
                raise Unusable(f"{target} is an object already built: it takes no options")
            return obj
        if not callable(obj):
            raise Unusable(
                f"{target} is {type(obj).__name__}: name a function of the inputs "
                "(list[str] -> list[str]), a class, a factory or an object with infer(inputs)"
            )
        shape = _positional(obj)
        if shape is None or shape[0] == 1:  # a batch function
            if options:
                raise Unusable(
                    f"{target} is a batch function: it takes no options (give a class or a "
                    "factory to have options passed to it)"
                )
            return None
        if shape[0] == 0:  # a factory
            return _construct(obj, target, options)
        raise Unusable(
            f"{target} takes {shape[0]} arguments: a batch function takes one, the list of inputs"
        )

    # -- the contract --------------------------------------------------------

    def infer(self, inputs: list[str]) -> list[str]:
        check_batch(inputs)
        return self._checked(self._run(self._infer, list(inputs)), len(inputs))

    def infer_sampled(self, inputs: list[str], temperatures: list[float]) -> list[str]:
        check_batch(inputs)
        if self._sampled is None:
            if any(temperatures):
                raise BackendError("this backend does not sample (it has no infer_sampled)")
            return self.infer(inputs)
        outputs = self._run(self._sampled, list(inputs), list(temperatures))
        return self._checked(outputs, len(inputs))

    def clip(self, text: str, max_tokens: int) -> tuple[str, int]:
        try:
            if self._clip is not None:
                out, tokens = self._clip(text, max_tokens)
                return str(out), int(tokens)
            if self._count is not None:
                return text, int(self._count(text))
        except Exception:  # (its counter failing costs the count, not the answer)
            return text, 0
        return clip_words(text, 0)

    def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            result = fn(*args)
            if inspect.isawaitable(result):
                result = self._loop.run(_awaited(result))
        except BackendError:
            raise
        except (
            Exception,
            SystemExit,
        ) as exc:  # (its code's failure is its call's, not the worker's)
            raise BackendError(f"{type(exc).__name__}: {str(exc)[:300]}") from exc
        return result

    @staticmethod
    def _checked(outputs: Any, count: int) -> list[str]:
        if not isinstance(outputs, list | tuple):
            raise BackendError(
                f"the backend returned {type(outputs).__name__}, not a list of strings"
            )
        for i, out in enumerate(outputs):
            if not isinstance(out, str):
                raise BackendError(f"output {i} is {type(out).__name__}, not a string")
        if len(outputs) != count:
            raise BackendError(f"the backend returned {len(outputs)} outputs for {count} inputs")
        return list(outputs)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _construct(factory: Callable[..., Any], target: str, options: dict[str, Any]) -> Any:
    """The team's instance, built once with the model's options."""
    try:
        built = factory(**options)
    except Exception as exc:  # (the team's constructor: loading weights, ...)
        raise Unusable(f"building {target} failed: {type(exc).__name__}: {exc}") from None
    if inspect.isawaitable(built):
        if inspect.iscoroutine(built):
            built.close()
        raise Unusable(f"{target} is an async factory; make it a plain one")
    return built
