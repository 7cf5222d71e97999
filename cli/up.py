"""``infergate up``: a whole local stack, each part its own OS process.

Starts (or uses, with REDIS_URL) Redis, then workers, dispatchers and
gateways as ``python -m infergate <role> ...`` children; waits until the
gateway is ready; restarts a child that dies (with backoff); with
``--workers MIN:MAX`` follows the autoscaling signal (``scaling.py``); on
SIGINT, SIGTERM or SIGHUP stops every child it started (SIGTERM, then
SIGKILL after a bound) and its own Redis.
"""

import argparse
import functools
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import FrameType

from infergate.base import logs, runtime
from infergate.base.queue import redis_url, shards
from infergate.base.queue.scale_signal import SignalReader
from infergate.base.queue.warming import WarmingWord
from infergate.children import Child, Stack
from infergate.policies import PolicyError, load_policy
from infergate.policies.demo import ADMIN_TIER, demo_policy
from infergate.policies.loader import public_error
from infergate.policies.models import MAX_CONCURRENCY, ONE_CALL_AT_A_TIME
from infergate.policies.schema import Model
from infergate.private_file import write_private
from infergate.redis_server import RedisServer
from infergate.scaling import WorkerScaler
from infergate.serving import checked_spec, simulated

log = logs.get(__name__)


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return int(resp.status) == 200
    except (urllib.error.URLError, OSError):
        return False


def _policy_path(args: argparse.Namespace, tmp: Path) -> str | None:
    """The policy file the stack runs: the one given (checked), or the demo
    policy with fresh keys written under ``tmp``. None (said on stderr) if the
    given one is invalid or the demo keys cannot be written where asked."""
    if args.policy:
        try:
            policy = load_policy(args.policy)
        except PolicyError as exc:
            print(f"infergate up: the policy is not valid:\n{public_error(exc)}", file=sys.stderr)
            return None
        unlisted = [name for name, _ in args.models or [] if name not in policy.models]
        if unlisted:
            print(
                f"infergate up: --models names {', '.join(unlisted)}, which the policy does not "
                f"list (its models: {', '.join(policy.models)})",
                file=sys.stderr,
            )
            return None
        if policy.document.keys:
            if args.keys_out:
                print(
                    "infergate up: --keys-out writes demo keys, and only for a policy without "
                    "keys; ignored",
                    file=sys.stderr,
                )
            return str(Path(args.policy).resolve())
        # A policy without keys (its tiers and models to try): demo keys are added.
        text, keys = demo_policy(Path(args.policy).read_text("utf-8"))
    else:
        text, keys = demo_policy()
    if args.models and not args.policy:
        text += (
            "\n# The models of `infergate up --models`: simulated, each naming itself.\nmodels:\n"
        )
        text += "".join(f"  {name}: {{backend: simulated}}\n" for name, _ in args.models)
    path = tmp / "demo-policy.yaml"
    path.write_text(text, "utf-8")
    print("infergate up: demo API keys (one per tier):", file=sys.stderr)
    for tier, secret in keys.items():
        admin = "  (the admin key: /v1/status, /v1/admin/*)" if tier == ADMIN_TIER else ""
        print(f"  {tier:<10} {secret}{admin}", file=sys.stderr)
    if args.keys_out:
        try:
            write_private(Path(args.keys_out), json.dumps(keys, indent=2) + "\n")
        except OSError as exc:
            print(f"infergate up: --keys-out: {exc}", file=sys.stderr)
            return None
    return str(path)


def _children(args: argparse.Namespace, policy_path: str, gpus: list[str]) -> list[Child]:
    """The stack at start: the fewest workers asked for, the dispatchers and gateways."""
    if args.models:
        return _model_children(args, policy_path, gpus)
    low, high = args.workers
    gateway_args = _gateway_args(args, policy_path)
    others = [
        *(
            Child(f"dispatcher-{i + 1}", "dispatcher", ["--policy", policy_path])
            for i in range(args.dispatchers)
        ),
        *(Child(f"gateway-{i + 1}", "gateway", list(gateway_args)) for i in range(args.gateways)),
    ]
    if args.metrics_port:
        # Worker slots take the first ports (as many as the most workers), the rest follow.
        for i, child in enumerate(others):
            child.argv += ["--metrics-port", str(args.metrics_port + high + i)]
    if gpus and high > len(gpus):
        print(
            f"infergate up: up to {high} workers share {len(gpus)} GPUs; "
            "each runs one batch at a time, so they take turns on a GPU",
            file=sys.stderr,
        )
    return [*(worker_child(args, policy_path, slot, gpus) for slot in range(low)), *others]


def _gateway_args(args: argparse.Namespace, policy_path: str) -> list[str]:
    out = ["--policy", policy_path, "--host", args.host, "--port", str(args.port)]
    return out + (["--grpc-port", str(args.grpc_port)] if args.grpc_port else [])


def _model_children(args: argparse.Namespace, policy_path: str, gpus: list[str]) -> list[Child]:
    """``--models``: each model's workers and dispatchers, then the gateways
    (which serve them all); metrics ports one after another in that order."""
    children: list[Child] = []
    slot = 0
    for name, count in args.models:
        for _ in range(count):
            children.append(worker_child(args, policy_path, slot, gpus, name))
            slot += 1
        argv = ["--policy", policy_path, "--model-name", name]
        children += [
            Child(f"dispatcher-{name}-{i + 1}", "dispatcher", list(argv))
            for i in range(args.dispatchers)
        ]
    gateway_args = _gateway_args(args, policy_path)
    children += [
        Child(f"gateway-{i + 1}", "gateway", list(gateway_args)) for i in range(args.gateways)
    ]
    if args.metrics_port:  # worker slots first (0 .. slot-1), the others after them
        others = [c for c in children if c.role != "worker"]
        for i, child in enumerate(others):
            child.argv += ["--metrics-port", str(args.metrics_port + slot + i)]
    return children


# The worker's flags ``up`` passes on when given (a real model's settings).
WORKER_FLAGS = ("model", "gguf_file", "max_new_tokens", "device", "hang_timeout_ms", "concurrency")
# Backends whose code runs on the worker's GPU: one GPU each (a remote one's runs elsewhere).
ON_THE_GPU = ("transformers", "python")


def worker_child(
    args: argparse.Namespace, policy_path: str, slot: int, gpus: list[str], model: str = ""
) -> Child:
    """The worker in ``slot``: its name, its GPU and its metrics port follow
    from the slot; ``model``: the policy's model it serves (``--models``)."""
    argv = ["--backend", args.backend] if args.backend else []  # (else its model's)
    if args.sim_latency_ms is not None:
        argv += ["--sim-latency-ms", str(args.sim_latency_ms)]
    if args.sim_ms_per_ktoken:
        argv += ["--sim-ms-per-ktoken", str(args.sim_ms_per_ktoken)]
    if args.sim_new_token_weight != 1.0:
        argv += ["--sim-new-token-weight", str(args.sim_new_token_weight)]
    if args.sim_step_weight:
        argv += ["--sim-step-weight", str(args.sim_step_weight)]
    argv += ["--policy", policy_path]
    argv += _worker_flags(args)
    if model:
        argv += ["--model-name", model]
    if args.metrics_port:
        argv += ["--metrics-port", str(args.metrics_port + slot)]
    name = f"worker-{model}-{slot + 1}" if model else f"worker-{slot + 1}"
    child = Child(name, "worker", argv, slot=slot)
    if _backend_kind(args, policy_path, model) in ON_THE_GPU:
        # One GPU per worker (each sees it as cuda:0); CPU when there are none.
        child.env["CUDA_VISIBLE_DEVICES"] = gpus[slot % len(gpus)] if gpus else ""
    return child


def _worker_flags(args: argparse.Namespace) -> list[str]:
    """The flags of ``up`` a worker takes too, as given."""
    argv = []
    for flag in WORKER_FLAGS:
        if getattr(args, flag) is not None:
            argv += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    if args.backend_options:
        argv += ["--backend-options", json.dumps(args.backend_options)]
    return argv


def _backend_kind(args: argparse.Namespace, policy_path: str, model: str = "") -> str:
    """The kind of backend a worker runs: ``--backend``'s, else its model's
    in the policy (checked before any worker starts)."""
    if args.backend:
        return str(args.backend).strip().partition(":")[0]
    entry = _models_of(policy_path).get(model or "default")
    return "simulated" if entry is None else entry.backend.strip().partition(":")[0]


@functools.cache
def _models_of(policy_path: str) -> dict[str, Model]:
    return load_policy(policy_path).models


def _gpus(flag: str | None) -> list[str]:
    """The GPU ids to give workers: the flag's list, else what nvidia-smi lists."""
    if flag is not None:
        return [g.strip() for g in flag.split(",") if g.strip()]
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def _wait_ready(
    stack: Stack, url: str, stop_requested: list[int], timeout_s: float, warming: WarmingWord
) -> int | None:
    """None once the gateway answers ready; else the exit code to stop with.
    The wait lasts ``timeout_s``, and as long after it as a worker says it
    is warming up (a real model on a CPU takes a minute), and ``timeout_s``
    after the last word of it (a warm worker still has to join)."""
    started = last_word = time.monotonic()
    while not _ready(url):
        failed = stack.failed_child()
        if failed is not None:
            code = failed.proc.returncode if failed.proc else None
            print(
                f"infergate up: {failed.name} failed to start (exit code {code}); stopping",
                file=sys.stderr,
            )
            return 1
        if stop_requested:
            return 0
        now = time.monotonic()
        if now - started > timeout_s and warming.any():
            last_word = now
        if now - last_word > timeout_s:
            print(
                f"infergate up: not ready within {timeout_s:.0f}s ({url}), and no worker is "
                "warming up; stopping (--ready-timeout-s waits longer)",
                file=sys.stderr,
            )
            return 1
        time.sleep(0.1)
    return None


def _preflight(args: argparse.Namespace) -> str | None:
    """What cannot work, found before anything starts (Redis, the demo
    keys): the backend's spec and options, the gateway's port."""
    if args.concurrency is not None and not 1 <= args.concurrency <= MAX_CONCURRENCY:
        return f"--concurrency must be 1-{MAX_CONCURRENCY}"
    try:  # (the simulated backend's own checks, before its workers make one)
        simulated(args, args.sim_latency_ms or 0.0)
    except ValueError as exc:
        return f"simulated backend: {exc}"
    if args.backend:  # (a policy's own backends are checked with the policy)
        try:
            spec = checked_spec(args.backend, args.backend_options or {})
        except ValueError as exc:
            return str(exc)
        if args.concurrency and args.concurrency > 1 and spec.kind in ONE_CALL_AT_A_TIME:
            return f"--concurrency: the {spec.kind} backend runs one batch at a time"
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((args.host, args.port))
        except OSError as exc:
            return f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}"
    return None


def _metrics_ports_fit(args: argparse.Namespace) -> bool:
    """Every child's side port (worker slots, dispatchers, gateways) is a port."""
    workers, dispatchers = args.workers[1], args.dispatchers
    if args.models:
        workers = sum(n for _, n in args.models)
        dispatchers *= len(args.models)
    last = args.metrics_port + workers + dispatchers + args.gateways - 1
    if args.metrics_port and last > 65535:
        print(
            f"infergate up: --metrics-port {args.metrics_port} leaves no room for every "
            f"child's port (the last would be {last}); choose one at most {args.metrics_port - (last - 65535)}",
            file=sys.stderr,
        )
        return False
    return True


def run_stack(args: argparse.Namespace) -> int:
    logs.configure("up", "up")
    if not _metrics_ports_fit(args):
        return 2
    problem = _preflight(args)
    if problem is not None:
        print(f"infergate up: {problem}", file=sys.stderr)
        return 2
    if not 1 <= args.shards <= shards.MAX_SHARDS:
        print(f"infergate up: --shards is 1-{shards.MAX_SHARDS}", file=sys.stderr)
        return 2
    if args.models and args.workers[0] != args.workers[1]:
        print(
            "infergate up: --models gives each model's workers; not with --workers MIN:MAX",
            file=sys.stderr,
        )
        return 2
    stop_requested: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop_requested.append(signum)

    for signum in runtime.stop_signals():
        signal.signal(signum, on_signal)
    with tempfile.TemporaryDirectory(prefix="infergate-up-") as tmp:
        policy_path = _policy_path(args, Path(tmp))
        if policy_path is None:
            return 2
        url = os.environ.get("REDIS_URL")
        if url:
            try:
                given = shards.urls(url)
            except ValueError as exc:
                print(f"infergate up: REDIS_URL: {exc}", file=sys.stderr)
                return 2
            if not _autoscaled_on_one(args, len(given)):
                return 2
            return _run(args, policy_path, url, stop_requested)
        if not _autoscaled_on_one(args, args.shards):
            return 2
        servers: list[RedisServer] = []
        try:
            for _ in range(args.shards):
                servers.append(RedisServer().start())
                log.info("up.redis_started", url=servers[-1].url)
        except RuntimeError as exc:
            print(f"infergate up: cannot start Redis: {exc}", file=sys.stderr)
            for server in servers:
                server.close()
            return 1
        try:
            return _run(args, policy_path, " ".join(s.url for s in servers), stop_requested)
        finally:
            for server in servers:
                server.close()


def _autoscaled_on_one(args: argparse.Namespace, shard_count: int) -> bool:
    """The autoscaling signal is one shard's: ``--workers MIN:MAX`` needs one."""
    if shard_count > 1 and args.workers[0] != args.workers[1]:
        print(
            "infergate up: --workers MIN:MAX follows one Redis's signal; "
            "give a worker count with several shards",
            file=sys.stderr,
        )
        return False
    return True


def _run(args: argparse.Namespace, policy_path: str, url: str, stop: list[int]) -> int:
    """Start the children, wait until ready, supervise (and scale) until a
    signal, stop them."""
    env = {**os.environ, "REDIS_URL": url, "INFERGATE_NAMESPACE": args.namespace}
    served = [name for name, _ in args.models] if args.models else [""]
    on_the_gpu = any(_backend_kind(args, policy_path, m) in ON_THE_GPU for m in served)
    gpus = _gpus(args.gpus) if on_the_gpu else []
    stack = Stack(_children(args, policy_path, gpus), env)
    scaler = _scaler(args, policy_path, gpus, stack, url)
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    try:
        stack.start_all()
        # Without workers of its own the stack is up once its gateway answers
        # (ready once a worker elsewhere joins).
        probe = "/readyz" if args.workers[1] else "/healthz"
        warming = WarmingWord(url.split()[0], args.namespace)
        try:
            code = _wait_ready(
                stack, f"http://{host}:{args.port}{probe}", stop, args.ready_timeout_s, warming
            )
        finally:
            warming.close()
        if code is not None:
            return code
        _say_ready(args, url)
        if not args.workers[1] and not args.models:
            _say_how_to_join(args, policy_path, url)
        while not stop:
            stack.supervise_once()
            if scaler is not None:
                scaler.step()
            time.sleep(0.2)
        log.info("up.stopping", signal=stop[0])
        return 0
    except Exception:
        log.exception("up.failed")
        return 1
    finally:
        stack.stop_all()
        if scaler is not None:
            scaler.close()


def _scaler(
    args: argparse.Namespace, policy_path: str, gpus: list[str], stack: Stack, url: str
) -> WorkerScaler | None:
    """With ``--workers MIN:MAX``, what keeps the workers at the signal."""
    low, high = args.workers
    if low == high or args.models:
        return None

    def add() -> None:
        # A slot is free once its worker has exited: one still draining keeps
        # its GPU and its metrics port until then (the next step tries again).
        taken = {c.slot for c in stack.children if c.role == "worker"}
        free = [s for s in range(high) if s not in taken]
        if free:
            stack.add(worker_child(args, policy_path, free[0], gpus))

    def retire() -> None:
        stack.retire(max(stack.workers(), key=lambda c: c.slot))  # the highest-numbered

    reader = SignalReader(url, args.namespace)
    return WorkerScaler(reader, low, high, lambda: len(stack.workers()), add, retire)


def _count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def _say_ready(args: argparse.Namespace, url: str) -> None:
    low, high = args.workers
    workers = _count(low, "worker") if low == high else f"{low}-{high} workers (autoscaled)"
    dispatchers = args.dispatchers
    if args.models:
        workers = "models " + ", ".join(
            f"{name} ({_count(n, 'worker')})" for name, n in args.models
        )
        high, dispatchers = sum(n for _, n in args.models), dispatchers * len(args.models)
    if args.metrics_port:
        first_other = args.metrics_port + high
        print(
            f"infergate up: metrics at :{args.metrics_port}-{first_other - 1} (worker slots), "
            f":{first_other}-{first_other + dispatchers - 1} (dispatchers), "
            f":{first_other + dispatchers}-{first_other + dispatchers + args.gateways - 1}"
            " (gateways)",
            file=sys.stderr,
        )
    print(
        f"infergate up: ready at http://{args.host}:{args.port} "
        f"({_count(args.gateways, 'gateway')}, {_count(dispatchers, 'dispatcher')}, {workers}; "
        f"Redis {' '.join(redis_url.redact(u) for u in url.split())})",
        file=sys.stderr,
    )


def _say_how_to_join(args: argparse.Namespace, policy_path: str, url: str) -> None:
    """``--workers 0``: the command a worker on a GPU host runs to join."""
    policy = f" --policy {shlex.quote(args.policy)}" if args.policy else ""
    backend = ["--backend", args.backend] if args.backend else []
    flags = " ".join(shlex.quote(a) for a in [*backend, *_worker_flags(args)])
    print(
        "infergate up: no workers here; on each GPU host, one worker per GPU:\n"
        f"  REDIS_URL={shlex.quote(url)} INFERGATE_NAMESPACE={shlex.quote(args.namespace)} "
        f"infergate worker {flags}{policy}",
        file=sys.stderr,
    )
    if "127.0.0.1" in url and "REDIS_URL" not in os.environ:
        print(
            "infergate up: (this Redis listens on 127.0.0.1 only: for workers on other hosts, "
            "start up with REDIS_URL naming a Redis they can reach)",
            file=sys.stderr,
        )
    if not args.policy:
        print(
            f"infergate up: (the demo policy is {policy_path}; give --policy FILE to share one)",
            file=sys.stderr,
        )
