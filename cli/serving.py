"""Which model a dispatcher or worker serves, and the backend a worker runs:
its flags first, then the policy's entry for its model (``models:``), then
the defaults."""

import argparse
import sys
from typing import TYPE_CHECKING

from infergate.policies.schema import Model

if TYPE_CHECKING:
    from infergate.gpu.backend import Backend
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


def backend_for(args: argparse.Namespace, model: Model) -> "Backend | None":
    """The backend the flags and the model's entry ask for, or None (and a
    message) if they cannot."""
    backend = args.backend or model.backend
    if backend == "simulated":
        from infergate.gpu.simulated import SimulatedBackend

        latency_ms = model.sim_latency_ms if args.sim_latency_ms is None else args.sim_latency_ms
        named = "" if args.model_name == "default" else args.model_name
        return SimulatedBackend(latency_ms, args.sim_fail_marker, args.sim_hang_marker, model=named)
    if backend == "transformers":
        path = args.model or model.path
        if not path:
            print(
                "infergate worker: --model (or the policy model's path) is required with "
                "--backend transformers",
                file=sys.stderr,
            )
            return None
        from infergate.gpu.transformers_backend import TransformersBackend

        return TransformersBackend(
            path,
            gguf_file=args.gguf_file or model.gguf_file,
            max_new_tokens=args.max_new_tokens or model.max_new_tokens,
            device=args.device or model.device,
        )
    print(
        f"infergate worker: unknown backend {backend!r}; use simulated or transformers",
        file=sys.stderr,
    )
    return None
