"""The one ``infergate`` command.

    infergate up            a whole local stack (Redis, gateway, dispatcher, workers)
    infergate gateway       one gateway process
    infergate dispatcher    one dispatcher process
    infergate worker        one GPU worker process
    infergate policy check  validate a policy file
    infergate keys new      make an API key and its policy entry

Every flag can also be set by an ``INFERGATE_<FLAG>`` environment variable
(``--sim-latency-ms`` is ``INFERGATE_SIM_LATENCY_MS``); ``REDIS_URL`` sets
the Redis of every component (several URLs, separated by whitespace: the
deployment's shards, base/queue/shards.py).
"""

import argparse
import contextlib
import dataclasses
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from infergate import __version__, plan, usage

if TYPE_CHECKING:
    from infergate.base.probes import Probes
    from infergate.base.settings import ProcessSettings
    from infergate.policies.live import LivePolicy
    from prometheus_client import CollectorRegistry

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


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


def _process(args: argparse.Namespace, role: str) -> dict[str, Any]:
    """Set up logging for this process and return its common settings."""
    from infergate.base import logs, tracing

    _check_redis_url(args.redis_url)
    process_id = args.id or f"{role}-{os.urandom(4).hex()}"
    logs.configure(role, process_id)
    tracing.setup(role, process_id)
    return {
        "process_id": process_id,
        "redis_url": args.redis_url,
        "namespace": args.namespace,
        "heartbeat_interval_ms": args.heartbeat_interval_ms,
        "heartbeat_ttl_ms": args.heartbeat_ttl_ms,
        **({"model": args.model_name} if role != "gateway" else {}),
    }


def _check_redis_url(url: str) -> None:
    """Exit with a message (never the password) if a Redis URL cannot work
    (several, separated by whitespace: the deployment's shards)."""
    from infergate.base.queue import shards

    try:
        shards.urls(url)
    except ValueError as exc:
        print(f"infergate: REDIS_URL / --redis-url: {exc}", file=sys.stderr)
        sys.exit(2)


def _up_parser(sub: Any) -> None:
    up = sub.add_parser("up", help="run a whole local stack")
    _add(up, "--host", "127.0.0.1", "address the gateway listens on")
    _add(up, "--port", 8000, "port the gateway listens on", port)
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
    _add(up, "--sim-latency-ms", 100, "simulated batch time", float)
    _add(up, "--policy", None, "policy file (default: the built-in demo policy with fresh keys)")
    _add(up, "--keys-out", None, "write the demo keys as JSON to this file")
    _add(up, "--namespace", "infergate", "key namespace of this deployment")
    _add(up, "--backend", "simulated", "worker backend: simulated or transformers")
    _add(up, "--model", None, "model path for the transformers backend")
    _add(up, "--gguf-file", None, "the GGUF file in the model's folder (transformers)")
    _add(up, "--max-new-tokens", None, "most tokens generated per input (transformers)", int)
    _add(up, "--device", None, "torch device of every worker, e.g. cpu (default: one GPU each)")
    _add(up, "--hang-timeout-ms", None, "the floor of the workers' hang timeout", int)
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
    _add(wk, "--backend", None, "simulated or transformers (default: the model's, or simulated)")
    _add(wk, "--sim-latency-ms", None, "simulated backend: time per batch (default 100)", float)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="infergate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"infergate {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_up_parser, _gateway_parser, _dispatcher_parser, _worker_parser, _tool_parsers):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "up":
        from infergate.up import run_stack

        return run_stack(args)
    if args.command == "gateway":
        return _gateway(args)
    if args.command == "dispatcher":
        return _dispatcher(args)
    if args.command == "worker":
        return _worker(args)
    if args.command == "policy":
        return _policy_check(args.file)
    if args.command == "keys":
        return _keys_new(args)
    if args.command == "usage":
        return usage.run(args)
    if args.command == "plan":
        return plan.run(args)
    return 2


@contextlib.contextmanager
def _side_port(
    args: argparse.Namespace, registry: "CollectorRegistry", probes: "Probes"
) -> Iterator[None]:
    """This process's /metrics, /healthz and /readyz on its own port, for as long as it runs."""
    if not args.metrics_port:
        yield
        return
    from infergate.base import probes as side_port

    try:
        stop = side_port.serve(registry, probes, args.metrics_port, args.metrics_host)
    except OSError as exc:
        print(
            f"infergate: cannot serve --metrics-port {args.metrics_port} on "
            f"{args.metrics_host}: {exc.strerror or exc}",
            file=sys.stderr,
        )
        sys.exit(2)
    try:
        yield
    finally:
        stop()


def _live_policy(args: argparse.Namespace, required: bool) -> "LivePolicy":
    """The policy this process starts on: its file, or, while the file is
    invalid or unreadable, the fleet's last valid policy kept in Redis (the
    file's problem is then reported, not fatal); the built-in example when
    no file is given and none is required."""
    from infergate.base import logs
    from infergate.base.queue.policy_copy import fetch_policy
    from infergate.policies import PolicyError, parse_policy
    from infergate.policies.demo import example_text
    from infergate.policies.live import LivePolicy
    from infergate.policies.loader import public_error, read_policy_text

    path, max_bytes = args.policy, args.max_policy_bytes
    if not path:
        if required:
            print("infergate: --policy FILE (or INFERGATE_POLICY) is required", file=sys.stderr)
            sys.exit(2)
        text = example_text()
        return LivePolicy(parse_policy(text, "policies/example.yaml"), None, text=text)
    try:
        text = read_policy_text(path, max_bytes)
        return LivePolicy(parse_policy(text, path), path, text=text, max_bytes=max_bytes)
    except PolicyError as exc:
        copy = fetch_policy(args.redis_url.split()[0], args.namespace)  # (the first shard's)
        if copy is None:
            print(
                "infergate: the policy is not valid, and Redis holds no last valid one:\n"
                + public_error(exc),
                file=sys.stderr,
            )
            sys.exit(2)
        error = public_error(exc)
    logs.get(__name__).error(
        "policy.file_invalid_starting_on_last_valid", error=error, version=copy.version
    )
    policy = parse_policy(copy.text, "the last valid policy (Redis)")
    return LivePolicy(policy, path, text=copy.text, error=error, max_bytes=max_bytes)


def _gateway(args: argparse.Namespace) -> int:
    import uvloop
    from infergate.gateway.limits import EdgeLimits
    from infergate.gateway.server import reuseport_socket, serve
    from infergate.gateway.service import Gateway, GatewaySettings

    settings = GatewaySettings(**_process(args, "gateway"))
    try:
        sock = reuseport_socket(args.host, args.port)
    except OSError as exc:
        print(
            f"infergate gateway: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}",
            file=sys.stderr,
        )
        return 2
    # Each edge limit has a flag of the same name.
    limits = EdgeLimits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EdgeLimits)})
    gateway = Gateway(settings, _live_policy(args, required=True), limits.max_connections)
    with _side_port(args, gateway.registry, gateway.probes()):
        return uvloop.run(serve(gateway, sock, args.drain_timeout_s, limits))


def _dispatcher(args: argparse.Namespace) -> int:
    from infergate.base import runtime
    from infergate.base.shard_group import one_or_group
    from infergate.dispatcher.service import Dispatcher, DispatcherSettings
    from infergate.serving import serve_model

    settings = DispatcherSettings(**_process(args, "dispatcher"))
    live = _live_policy(args, required=False)
    if serve_model(args, live, "dispatcher") is None:
        return 2
    # (each member its own live policy: each keeps it on its own shard)
    each = _per_shard(settings)
    lives = [live, *(_live_policy(args, required=False) for _ in each[1:])]
    dispatcher = one_or_group([Dispatcher(s, lv) for s, lv in zip(each, lives, strict=True)])
    with _side_port(args, dispatcher.registry, dispatcher.probes()):
        return runtime.run(dispatcher.serve)


S = TypeVar("S", bound="ProcessSettings")


def _per_shard(settings: S) -> list[S]:
    """One process's settings for each Redis shard it serves."""
    return [dataclasses.replace(settings, redis_url=url) for url in settings.redis_url.split()]


def _worker(args: argparse.Namespace) -> int:
    from infergate.base import runtime
    from infergate.base.shard_group import one_or_group
    from infergate.gpu.gate import Gate, GatedBackend
    from infergate.gpu.worker import Worker, WorkerSettings
    from infergate.serving import backend_for, serve_model

    common = _process(args, "worker")
    live = _live_policy(args, required=False)
    model = serve_model(args, live, "worker")
    backend = None if model is None else backend_for(args, model)
    if backend is None:
        return 2
    document = live.current.document
    workers = document.workers
    settings = WorkerSettings(
        **common,
        hang_timeout_ms=args.hang_timeout_ms or workers.hang_timeout_ms,
        max_attempts=workers.max_attempts,
        usage_retention_s=round(document.usage.retention_days * 86_400),
        max_batch=document.batching.max_batch_size,
    )
    each = _per_shard(settings)
    if len(each) > 1:  # (one backend, one call at a time, for every shard's loop)
        gate = Gate(backend, settings.max_batch)
        members = [Worker(s, GatedBackend(gate, i)) for i, s in enumerate(each)]
    else:
        members = [Worker(settings, backend)]
    worker = one_or_group(members)
    with _side_port(args, worker.registry, worker.probes()):
        # (its batch's hang timeout, as measured then, and 10 s to answer it)
        return runtime.run(
            worker.serve,
            shutdown_grace_s=lambda: max(w.runner.hang_timeout_ms for w in members) / 1000.0 + 10.0,
        )


def _policy_check(path: str) -> int:
    from infergate.policies import PolicyError, load_policy

    try:
        policy = load_policy(path)
    except PolicyError as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        return 1
    keys = policy.document.keys
    print(
        f"{path}: ok: version {policy.version}, {len(policy.tiers)} tiers, "
        f"{len(keys)} keys ({sum(k.disabled for k in keys)} disabled, {sum(k.admin for k in keys)} admin)"
    )
    return 0


def _keys_new(args: argparse.Namespace) -> int:
    from infergate.base.tiers import TIERS
    from infergate.policies.demo import new_secret
    from infergate.policies.loader import digest

    if args.tier not in TIERS:
        print(f"infergate keys new: --tier must be one of {', '.join(TIERS)}", file=sys.stderr)
        return 2
    secret = new_secret(args.tier)
    print(
        f"API key (shown once; give it to the client, it is not stored anywhere):\n\n  {secret}\n"
    )
    print("Add this entry under `keys:` in the policy file:\n")
    print(
        f"  - id: {args.id}\n    tier: {args.tier}\n    sha256: {digest(secret)}"
        + ("\n    admin: true" if args.admin else "")
    )
    return 0
