"""Which model a dispatcher or worker serves, and the backend a worker runs:
its flags first, then the policy's entry for its model (``models:``), then
the defaults. A backend that cannot be made (a bad spec or options, code
that does not import, a credential variable unset) is one line on stderr,
and the worker exits 2 before it joins the fleet."""

import argparse
import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import yaml
from infergate.base.queue.warming import WarmingWord
from infergate.policies.backends import BackendSpec, check_options, parse_spec
from infergate.policies.schema import Model

if TYPE_CHECKING:
    from infergate.gpu.backend import Backend
    from infergate.gpu.backends.simulated import SimulatedBackend
    from infergate.policies.live import LivePolicy


def serve_model(args: argparse.Namespace, live: "LivePolicy", role: str) -> Model | None:
    """The policy's entry for the model named by ``--model-name``, with the
    live policy turned to that model's view; None (and a message) if the
    policy does not list it."""
    name = args.model_name
    models = live.current.models
    if name not in models:
        print(
            f"infergate {role}: --model-name {name[:80]!r} is not a model of the policy "
            f"(its models: {', '.join(models)})",
            file=sys.stderr,
        )
        return None
    live.model = name
    return models[name]


@contextlib.contextmanager
def warming_said(redis_url: str, namespace: str, process_id: str) -> Iterator[None]:
    """While the block runs (the backend is made: a model's weights load),
    the worker says it is warming up (on the first shard), every two
    seconds, for five; the warm-up itself says so next."""
    word = WarmingWord(redis_url.split()[0], namespace)
    done = threading.Event()

    def say() -> None:
        while not done.is_set():
            word.say(process_id, 5_000)
            done.wait(2.0)

    thread = threading.Thread(target=say, name="warming", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(2.0)
        word.close()


def backend_options(text: str | None) -> dict[str, Any]:
    """``--backend-options``: a YAML (or JSON) mapping, e.g. '{model: echo}'."""
    if not text:
        return {}
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"{text[:80]!r} is not a mapping; write e.g. '{{model: echo, timeout_ms: 30000}}'"
        )
    return value


def checked_spec(text: str, options: dict[str, Any]) -> BackendSpec:
    """The backend ``--backend`` names, once it and ``--backend-options``
    are checked; else ValueError, every problem on one line."""
    try:
        spec = parse_spec(text)
    except ValueError as exc:
        raise ValueError(f"--backend: {exc}") from None
    problems = check_options(spec, options)
    if problems:
        said = "; ".join(f"{name or 'options'}: {why}" for name, why in problems)
        raise ValueError(f"--backend-options: {said}")
    return spec


def backend_for(
    args: argparse.Namespace, model: Model, command: str = "infergate worker"
) -> "Backend | None":
    """The backend the flags and the model's entry ask for, or None (and a
    line on stderr from ``command``) if they cannot. The policy's options go
    with the policy's backend; ``--backend-options`` add to them (or are all,
    for another)."""
    from infergate.gpu.backend import Unusable

    text = args.backend or model.backend
    options = {**(model.options if text == model.backend else {}), **(args.backend_options or {})}
    try:
        spec = checked_spec(text, options)
    except ValueError as exc:
        print(f"{command}: {exc}", file=sys.stderr)
        return None
    try:
        return build(args, model, spec, options)
    except (Unusable, ValueError) as exc:
        print(f"{command}: {spec.kind} backend: {exc}", file=sys.stderr)
        return None


def simulated(
    args: argparse.Namespace,
    latency_ms: float,
    model: str = "",
    fail_marker: str | None = None,
    hang_marker: str | None = None,
) -> "SimulatedBackend":
    """The simulated backend of the ``--sim-*`` flags (``up`` makes one to
    check them before it starts anything)."""
    from infergate.gpu.backends.simulated import SimulatedBackend

    return SimulatedBackend(
        latency_ms,
        fail_marker,
        hang_marker,
        model=model,
        ms_per_ktoken=args.sim_ms_per_ktoken,
        new_token_weight=args.sim_new_token_weight,
        step_weight=args.sim_step_weight,
    )


def build(
    args: argparse.Namespace, model: Model, spec: BackendSpec, options: dict[str, Any]
) -> "Backend":
    if spec.kind == "simulated":
        latency_ms = model.sim_latency_ms if args.sim_latency_ms is None else args.sim_latency_ms
        named = "" if args.model_name == "default" else args.model_name
        return simulated(args, latency_ms, named, args.sim_fail_marker, args.sim_hang_marker)
    max_new_tokens = args.max_new_tokens or model.max_new_tokens
    if spec.kind == "transformers":
        path = args.model or model.path
        if not path:
            raise ValueError("--model (or the policy model's path) is required")
        from infergate.gpu.backends.transformers_backend import TransformersBackend

        return TransformersBackend(
            path,
            gguf_file=args.gguf_file or model.gguf_file,
            max_new_tokens=max_new_tokens,
            device=args.device or model.device,
        )
    if spec.kind == "python":
        from infergate.gpu.backends.python_code import PythonBackend

        return PythonBackend(spec.target, options)
    if spec.kind == "http":
        from infergate.gpu.backends.http_batch import HttpBatchBackend

        return HttpBatchBackend(spec.target, options)
    if spec.kind == "kserve-v2":
        from infergate.gpu.backends.kserve import KServeBackend

        return KServeBackend(spec.target, options)
    from infergate.gpu.backends.openai_engine import OpenAIEngineBackend

    return OpenAIEngineBackend(spec.target, options, max_new_tokens)
