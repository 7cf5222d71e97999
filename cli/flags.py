"""Every flag of the ``infergate`` command, by subcommand: the one parser.

Every flag can also be set by an ``INFERGATE_<FLAG>`` environment variable
(``--sim-latency-ms`` is ``INFERGATE_SIM_LATENCY_MS``); ``REDIS_URL`` sets
the Redis of every component (several URLs, separated by whitespace: the
deployment's shards, base/queue/shards.py).
"""

import argparse
import os
from typing import Any

from infergate import __version__, backend_check, plan, usage
from infergate.serving import backend_options

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DESCRIPTION = (
    "A priority-tiered inference gateway: a synchronous HTTP API over batching GPU workers."
)


def port(text: str) -> int:
    """A TCP port, 0-65535 (0: off, where the flag allows it)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (0-65535)")
    return value


def _env(name: str, default: Any) -> Any:
    return os.environ.get("INFERGATE_" + name.upper().replace("-", "_"), default)


def _add(p: argparse.ArgumentParser, flag: str, default: Any, help: str, type: Any = str) -> None:
    name = flag.lstrip("-")
    # A value from the environment stays a string: argparse converts it with
    # ``type`` when this command runs, so a bad one is a usage error of this
    # command, not a traceback of every command.
    env_default = _env(name, default)
    p.add_argument(
        flag,
        default=env_default,
        type=type,
        help=help + f" (env INFERGATE_{name.upper().replace('-', '_')})",
    )


def _common(p: argparse.ArgumentParser, role: str) -> None:
    p.add_argument(
        "--redis-url",
        default=os.environ.get("REDIS_URL", DEFAULT_REDIS_URL),
        help="Redis to use (env REDIS_URL)",
    )
    _add(p, "--namespace", "infergate", "key namespace (Redis Cluster hash tag) of this deployment")
    _add(p, "--id", None, f"this {role}'s id (default: {role}-<random>)")
    _add(p, "--heartbeat-interval-ms", 250, "how often to beat", int)
    _add(p, "--metrics-port", 0, "serve metrics and probes on this port (0: off)", port)
    _add(p, "--metrics-host", "127.0.0.1", "address of the metrics port (0.0.0.0: every interface)")
    _add(
        p,
        "--max-policy-bytes",
        8 * 1024 * 1024,
        "a policy file larger than this is refused unread",
        int,
    )
    _add(
        p,
        "--heartbeat-ttl-ms",
        1000,
        "how long a beat lasts; an owner silent this long is dead",
        int,
    )


def _up_parser(sub: Any) -> None:
    up = sub.add_parser("up", help="run a whole local stack")
    _add(up, "--host", "127.0.0.1", "address the gateway listens on")
    _add(up, "--port", 8000, "port the gateway listens on", port)
    _add(up, "--grpc-port", 0, "port the gateways serve the gRPC API on (0: off)", port)
    from infergate.scaling import worker_range

    _add(
        up,
        "--workers",
        "4",
        "workers: a count, or MIN:MAX to follow the autoscaling signal",
        worker_range,
    )
    _add(up, "--dispatchers", 1, "dispatcher processes", int)
    _add(up, "--shards", 1, "Redis servers to start, one shard each (not with REDIS_URL)", int)
    _add(up, "--gateways", 1, "gateway processes (sharing the port)", int)
    _add(
        up,
        "--sim-latency-ms",
        None,
        "simulated batch time (default: each model's in the policy, 100)",
        float,
    )
    _add(
        up,
        "--sim-ms-per-ktoken",
        0.0,
        "simulated batch time per 1,000 tokens (words) in and out of it, on top (default 0)",
        float,
    )
    _add(
        up,
        "--sim-new-token-weight",
        1.0,
        "simulated: a token out costs this many tokens in, with --sim-ms-per-ktoken (default 1)",
        float,
    )
    _add(
        up,
        "--sim-step-weight",
        0.0,
        "simulated: each decoding step of a batch costs this many tokens in more (default 0)",
        float,
    )
    _add(up, "--policy", None, "policy file (default: the built-in demo policy with fresh keys)")
    _add(up, "--keys-out", None, "write the demo keys as JSON to this file")
    _add(up, "--namespace", "infergate", "key namespace of this deployment")
    _add(
        up,
        "--backend",
        None,
        "the workers' backend: simulated, transformers, python:pkg.module:attr, http:URL, "
        "kserve-v2:URL or openai:URL (default: each model's in the policy, else simulated)",
    )
    _add(
        up,
        "--backend-options",
        None,
        "the backend's options, a mapping: '{model: m}'",
        backend_options,
    )
    _add(
        up,
        "--concurrency",
        None,
        "batches each worker keeps in flight (default: the policy's)",
        int,
    )
    _add(up, "--model", None, "model path for the transformers backend")
    _add(up, "--gguf-file", None, "the GGUF file in the model's folder (transformers)")
    _add(up, "--max-new-tokens", None, "most tokens generated per input (transformers)", int)
    _add(up, "--device", None, "torch device of every worker, e.g. cpu (default: one GPU each)")
    _add(up, "--hang-timeout-ms", None, "the floor of the workers' hang timeout", int)
    _add(
        up,
        "--ready-timeout-s",
        60.0,
        "how long to wait for the stack to be ready, and longer while a worker warms up",
        float,
    )
    from infergate.scaling import model_counts

    _add(
        up,
        "--models",
        None,
        "simulated worker groups per model, e.g. small=2,large=1 (each its own dispatcher)",
        model_counts,
    )
    _add(
        up,
        "--gpus",
        None,
        "GPU ids to share among the workers, one per worker (default: every GPU nvidia-smi lists)",
    )
    _add(
        up,
        "--metrics-port",
        0,
        "serve each child's Prometheus metrics, on this port and the next ones (0: off)",
        port,
    )


def _gateway_parser(sub: Any) -> None:
    gw = sub.add_parser("gateway", help="run one gateway process")
    _common(gw, "gateway")
    _add(gw, "--host", "127.0.0.1", "address to listen on")
    _add(
        gw, "--port", 8000, "port to listen on (shared with other gateways via SO_REUSEPORT)", port
    )
    _add(gw, "--policy", None, "policy file (required)")
    _add(gw, "--drain-timeout-s", 10, "on SIGTERM, how long to wait for open requests", float)
    _add(gw, "--grpc-port", 0, "serve the gRPC API on this port too (shared too; 0: off)", port)
    from infergate.gateway.limits import EdgeLimits

    edge = EdgeLimits()
    _add(gw, "--max-head-bytes", edge.max_head_bytes, "request line and headers, in all (431)", int)
    _add(gw, "--max-header-bytes", edge.max_header_bytes, "one header, name and value (431)", int)
    _add(gw, "--max-headers", edge.max_headers, "headers in one request (431)", int)
    _add(gw, "--head-timeout-s", edge.head_timeout_s, "time to send the request head (408)", float)
    _add(gw, "--body-timeout-s", edge.body_timeout_s, "time to send the request body (408)", float)
    _add(
        gw,
        "--keep-alive-s",
        edge.keep_alive_s,
        "idle time before a kept-alive connection is closed",
        float,
    )
    _add(
        gw,
        "--max-connections",
        edge.max_connections,
        "open connections per process; more are closed at once",
        int,
    )
    _add(
        gw,
        "--max-pipelined",
        edge.max_pipelined,
        "requests one connection may have waiting behind its answer; one more: 429, closed",
        int,
    )
    _add(
        gw,
        "--send-timeout-s",
        edge.send_timeout_s,
        "how long an answer may sit unread by its client before the connection is closed",
        float,
    )


def _dispatcher_parser(sub: Any) -> None:
    dp = sub.add_parser("dispatcher", help="run one dispatcher process")
    _common(dp, "dispatcher")
    _add(dp, "--policy", None, "policy file for the batching settings (default: built-in)")
    _add(dp, "--model-name", "default", "the policy's model whose requests it batches")


def _worker_parser(sub: Any) -> None:
    wk = sub.add_parser("worker", help="run one GPU worker process")
    _common(wk, "worker")
    _add(wk, "--model-name", "default", "the policy's model it serves (its entry's settings)")
    _add(
        wk,
        "--backend",
        None,
        "simulated, transformers, python:pkg.module:attr, http:URL, kserve-v2:URL or "
        "openai:URL (default: the model's, or simulated)",
    )
    _add(
        wk,
        "--backend-options",
        None,
        "the backend's options, a YAML mapping, e.g. '{model: echo, timeout_ms: 30000}' "
        "(added to the policy model's)",
        backend_options,
    )
    _add(
        wk,
        "--concurrency",
        None,
        "batches this worker keeps in flight, each a slot of its own (default: the policy's "
        "workers.concurrency, 1)",
        int,
    )
    _add(wk, "--sim-latency-ms", None, "simulated backend: time per batch (default 100)", float)
    _add(
        wk,
        "--sim-ms-per-ktoken",
        0.0,
        "simulated backend: more time per 1,000 tokens (words) in and out of a batch (default 0)",
        float,
    )
    _add(
        wk,
        "--sim-new-token-weight",
        1.0,
        "simulated backend: a token out costs this many tokens in, with --sim-ms-per-ktoken "
        "(default 1)",
        float,
    )
    _add(
        wk,
        "--sim-step-weight",
        0.0,
        "simulated backend: each decoding step of a batch (its longest answer's words) costs "
        "this many tokens in more, with --sim-ms-per-ktoken (default 0)",
        float,
    )
    _add(
        wk,
        "--sim-fail-marker",
        "",
        "simulated backend, for tests: inputs containing this fail (default: off)",
    )
    _add(
        wk,
        "--sim-hang-marker",
        "",
        "simulated backend, for tests: inputs containing this hang the backend (default: off)",
    )
    _add(wk, "--model", None, "transformers backend: model directory")
    _add(wk, "--gguf-file", None, "transformers backend: GGUF file inside the model directory")
    _add(
        wk,
        "--max-new-tokens",
        None,
        "transformers backend: most tokens generated per input (default 16)",
        int,
    )
    _add(
        wk,
        "--device",
        None,
        "transformers backend: torch device, e.g. cuda:0 or cpu (default: cuda when present)",
    )
    _add(wk, "--policy", None, "policy file for the worker settings (default: built-in)")
    _add(
        wk,
        "--hang-timeout-ms",
        None,
        "the floor of the hang timeout: a call past it and 4x the slowest call "
        "(warm-up included) ends the worker (default: the policy's)",
        int,
    )


def _tool_parsers(sub: Any) -> None:
    pol = sub.add_parser("policy", help="policy tools")
    polsub = pol.add_subparsers(dest="policy_command", required=True)
    chk = polsub.add_parser("check", help="validate a policy file")
    chk.add_argument("file")

    keys = sub.add_parser("keys", help="API key tools")
    keysub = keys.add_subparsers(dest="keys_command", required=True)
    new = keysub.add_parser("new", help="make a new API key and print its policy entry")
    new.add_argument("--tier", required=True)
    new.add_argument("--id", required=True)
    new.add_argument("--admin", action="store_true")
    usage.add_parser(sub)
    plan.add_parser(sub)
    backend_check.add_parser(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="infergate", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"infergate {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_up_parser, _gateway_parser, _dispatcher_parser, _worker_parser, _tool_parsers):
        add(sub)
    return parser
