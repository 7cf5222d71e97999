"""The one ``infergate`` command.

    infergate up            a whole local stack (Redis, gateway, dispatcher, workers)
    infergate gateway       one gateway process
    infergate dispatcher    one dispatcher process
    infergate worker        one GPU worker process
    infergate policy check  validate a policy file
    infergate keys new      make an API key and its policy entry
    infergate usage         what each key used
    infergate plan          size a deployment for a target load
    infergate backend check a backend against the batch contract

Its flags are ``flags.py``; this module runs what they ask for.
"""

import argparse
import contextlib
import dataclasses
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from infergate import backend_check, plan, usage
from infergate.flags import build_parser

if TYPE_CHECKING:
    from infergate.base.probes import Probes
    from infergate.base.settings import ProcessSettings
    from infergate.policies.live import LivePolicy
    from prometheus_client import CollectorRegistry


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


def main(argv: list[str] | None = None) -> int:
    try:
        return _run(build_parser().parse_args(argv))
    except BrokenPipeError:  # (its output piped into `head`: no traceback for that)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _run(args: argparse.Namespace) -> int:
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
    if args.command == "backend":
        return backend_check.run(args)
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
    from infergate.direct_calls import direct_call
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
    gateway = Gateway(
        settings, _live_policy(args, required=True), limits.max_connections, direct_call
    )
    with _side_port(args, gateway.registry, gateway.probes()):
        return uvloop.run(serve(gateway, sock, args.drain_timeout_s, limits, args.grpc_port))


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
    from infergate.gpu.worker import SharedWarmUp, Worker, WorkerSettings
    from infergate.policies.models import MAX_CONCURRENCY, ONE_CALL_AT_A_TIME
    from infergate.serving import backend_for, serve_model, warming_said

    common = _process(args, "worker")
    live = _live_policy(args, required=False)
    model = serve_model(args, live, "worker")
    if model is None:
        return 2
    with warming_said(args.redis_url, args.namespace, common["process_id"]):
        backend = backend_for(args, model)
    if backend is None:
        return 2
    document = live.current.document
    workers = document.workers
    slots = workers.concurrency if args.concurrency is None else args.concurrency
    if not 1 <= slots <= MAX_CONCURRENCY:
        print(f"infergate worker: --concurrency must be 1-{MAX_CONCURRENCY}", file=sys.stderr)
        return 2
    if slots > 1 and backend.name in ONE_CALL_AT_A_TIME:
        print(
            f"infergate worker: the {backend.name} backend runs one batch at a time "
            "(--concurrency is for a server that batches by itself, or code that may be "
            "called from several threads)",
            file=sys.stderr,
        )
        return 2
    hang_floor_ms = args.hang_timeout_ms or workers.hang_timeout_ms
    if backend.upstream is not None:  # (a remote call returns by its own bound)
        hang_floor_ms = max(hang_floor_ms, backend.upstream.timeout_ms + 5_000)
    settings = WorkerSettings(
        **common,
        hang_timeout_ms=hang_floor_ms,
        max_attempts=workers.max_attempts,
        usage_retention_s=round(document.usage.retention_days * 86_400),
        max_batch=document.batching.max_batch_size,
        slots=slots,
    )
    members = []
    warm = SharedWarmUp()  # (one warm-up for the process: its slots share the backend)
    for slot in range(slots):
        # Each slot a worker of its own to the fleet (its id, credit, batches).
        named = (
            settings
            if slots == 1
            else dataclasses.replace(settings, process_id=f"{settings.process_id}.{slot}")
        )
        each = _per_shard(named)
        if len(each) > 1:  # (one call at a time a slot, for every shard's loop)
            gate = Gate(backend, settings.max_batch)
            members += [Worker(s, GatedBackend(gate, i), warm) for i, s in enumerate(each)]
        else:
            members.append(Worker(named, backend, warm))
    worker = one_or_group(members)
    try:
        with _side_port(args, worker.registry, worker.probes()):
            # (its batch's hang timeout, as measured then, and 10 s to answer it)
            return runtime.run(
                worker.serve,
                shutdown_grace_s=lambda: (
                    max(w.runner.hang_timeout_ms for w in members) / 1000.0 + 10.0
                ),
            )
    finally:
        if backend.upstream is not None:  # (once every slot is done with it)
            backend.upstream.close()


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
