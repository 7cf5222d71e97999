"""``infergate up``: a whole local stack, each part its own OS process.

Starts (or uses, with REDIS_URL) Redis, then workers, dispatchers and
gateways as ``python -m infergate <role> ...`` children; waits until the
gateway is ready; restarts a child that dies (with backoff); on SIGINT or
SIGTERM stops every child it started (SIGTERM, then SIGKILL after a bound)
and its own Redis.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from infergate.base import logs
from infergate.base.loops import Backoff
from infergate.policies import PolicyError, load_policy
from infergate.policies.demo import demo_policy
from infergate.policies.loader import public_error
from infergate.redis_server import RedisServer

log = logs.get(__name__)

STOP_TIMEOUT_S = 8.0
CHILD_STABLE_S = 30.0  # a child that lived this long restarts without waiting
READY_TIMEOUT_S = 60.0


@dataclass
class Child:
    name: str
    role: str
    argv: list[str]
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    next_start: float = 0.0
    started_at: float = 0.0
    ids: list[str] = field(default_factory=list)
    # Extra environment for this child alone (a worker's CUDA_VISIBLE_DEVICES).
    env: dict[str, str] = field(default_factory=dict)
    backoff: Backoff = field(default_factory=lambda: Backoff(base_s=0.5, cap_s=10.0))

    def start(self, env: dict[str, str]) -> None:
        process_id = f"{self.name}-{os.urandom(3).hex()}"
        self.ids.append(process_id)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "infergate", self.role, "--id", process_id, *self.argv],
            env={**env, **self.env},
            # Its own session: Ctrl-C reaches `up` alone, which then stops each
            # child once, with SIGTERM (a second signal would end it unclean).
            start_new_session=True,
        )
        self.started_at = time.monotonic()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Stack:
    def __init__(self, children: list[Child], env: dict[str, str]) -> None:
        self.children = children
        self.env = env
        self.stopping = False

    def start_all(self) -> None:
        for child in self.children:
            child.start(self.env)

    def failed_child(self) -> Child | None:
        return next((c for c in self.children if not c.alive()), None)

    def supervise_once(self) -> None:
        """Restart children that died, with backoff (reset after a long life)."""
        now = time.monotonic()
        for child in self.children:
            if child.alive() or self.stopping:
                continue
            if child.next_start == 0.0:
                code = child.proc.returncode if child.proc else None
                if now - child.started_at > CHILD_STABLE_S:
                    child.backoff.reset()
                delay = child.backoff.next_s()
                child.next_start = now + delay
                log.warning(
                    "up.child_died", child=child.name, exit_code=code, restart_in_s=round(delay, 2)
                )
            elif now >= child.next_start:
                child.restarts += 1
                child.next_start = 0.0
                child.start(self.env)
                log.info("up.child_restarted", child=child.name, restarts=child.restarts)

    def stop_all(self) -> None:
        self.stopping = True
        for child in self.children:
            if child.alive() and child.proc is not None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in self.children:
            if child.proc is None:
                continue
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("up.child_killed", child=child.name)
                child.proc.kill()
                child.proc.wait(5)


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return int(resp.status) == 200
    except (urllib.error.URLError, OSError):
        return False


def _policy_path(args: argparse.Namespace, tmp: Path) -> str | None:
    """The policy file the stack runs: the one given (checked), or the demo
    policy with fresh keys written under ``tmp``. None if the given one is invalid."""
    if args.policy:
        try:
            load_policy(args.policy)
        except PolicyError as exc:
            print(f"infergate up: the policy is not valid:\n{public_error(exc)}", file=sys.stderr)
            return None
        if args.keys_out:
            print(
                "infergate up: --keys-out writes demo keys, and only without --policy; ignored",
                file=sys.stderr,
            )
        return str(Path(args.policy).resolve())
    text, keys = demo_policy()
    path = tmp / "demo-policy.yaml"
    path.write_text(text, "utf-8")
    print("infergate up: demo API keys (one per tier):", file=sys.stderr)
    for tier, secret in keys.items():
        print(f"  {tier:<10} {secret}", file=sys.stderr)
    if args.keys_out:
        _write_private(Path(args.keys_out), json.dumps(keys, indent=2) + "\n")
    return str(path)


def _write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read (it holds secrets)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(path, 0o600)  # an existing file keeps its mode through O_CREAT


def _children(args: argparse.Namespace, policy_path: str) -> list[Child]:
    worker_args = [
        "--backend",
        args.backend,
        "--sim-latency-ms",
        str(args.sim_latency_ms),
        "--policy",
        policy_path,
    ]
    if args.model:
        worker_args += ["--model", args.model]
    gateway_args = ["--policy", policy_path, "--host", args.host, "--port", str(args.port)]
    children = [
        *(Child(f"worker-{i + 1}", "worker", list(worker_args)) for i in range(args.workers)),
        *(
            Child(f"dispatcher-{i + 1}", "dispatcher", ["--policy", policy_path])
            for i in range(args.dispatchers)
        ),
        *(Child(f"gateway-{i + 1}", "gateway", list(gateway_args)) for i in range(args.gateways)),
    ]
    if args.backend == "transformers":
        gpus = _gpus(args.gpus)
        workers = [c for c in children if c.role == "worker"]
        for i, worker in enumerate(workers):
            # One GPU per worker (each sees it as cuda:0); CPU when there are none.
            worker.env["CUDA_VISIBLE_DEVICES"] = gpus[i % len(gpus)] if gpus else ""
        if gpus and len(workers) > len(gpus):
            print(
                f"infergate up: {len(workers)} workers share {len(gpus)} GPUs; "
                "each runs one batch at a time, so they take turns on a GPU",
                file=sys.stderr,
            )
    if args.metrics_port:
        for i, child in enumerate(children):
            child.argv += ["--metrics-port", str(args.metrics_port + i)]
    return children


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


def _wait_ready(stack: Stack, url: str, stop_requested: list[int]) -> int | None:
    """None once the gateway answers ready; else the exit code to stop with."""
    deadline = time.monotonic() + READY_TIMEOUT_S
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
        if time.monotonic() > deadline:
            print(
                f"infergate up: not ready within {READY_TIMEOUT_S:.0f}s ({url}); stopping",
                file=sys.stderr,
            )
            return 1
        time.sleep(0.1)
    return None


def run_stack(args: argparse.Namespace) -> int:
    logs.configure("up", "up")
    stop_requested: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop_requested.append(signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    with tempfile.TemporaryDirectory(prefix="infergate-up-") as tmp:
        policy_path = _policy_path(args, Path(tmp))
        if policy_path is None:
            return 2
        redis_url = os.environ.get("REDIS_URL")
        if redis_url:
            return _run(args, policy_path, redis_url, stop_requested)
        try:
            redis_server = RedisServer().start()
        except RuntimeError as exc:
            print(f"infergate up: cannot start Redis: {exc}", file=sys.stderr)
            return 1
        log.info("up.redis_started", url=redis_server.url)
        try:
            return _run(args, policy_path, redis_server.url, stop_requested)
        finally:
            redis_server.close()


def _run(args: argparse.Namespace, policy_path: str, redis_url: str, stop: list[int]) -> int:
    """Start the children, wait until ready, supervise until a signal, stop them."""
    env = {**os.environ, "REDIS_URL": redis_url, "INFERGATE_NAMESPACE": args.namespace}
    stack = Stack(_children(args, policy_path), env)
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    try:
        stack.start_all()
        code = _wait_ready(stack, f"http://{host}:{args.port}/readyz", stop)
        if code is not None:
            return code
        if args.metrics_port:
            ports = ", ".join(
                f"{c.name} :{args.metrics_port + i}" for i, c in enumerate(stack.children)
            )
            print(f"infergate up: metrics at {ports}", file=sys.stderr)
        print(
            f"infergate up: ready at http://{args.host}:{args.port} "
            f"({args.gateways} gateway, {args.dispatchers} dispatcher, {args.workers} workers; Redis {redis_url})",
            file=sys.stderr,
        )
        while not stop:
            stack.supervise_once()
            time.sleep(0.2)
        log.info("up.stopping", signal=stop[0])
        return 0
    except Exception:
        log.exception("up.failed")
        return 1
    finally:
        stack.stop_all()
