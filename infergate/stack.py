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

from infergate import logs
from infergate.redis_server import RedisServer
from policies import PolicyError, load_policy
from policies.demo import demo_policy

log = logs.get(__name__)

STOP_TIMEOUT_S = 8.0
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

    def start(self, env: dict[str, str]) -> None:
        process_id = f"{self.name}-{os.urandom(3).hex()}"
        self.ids.append(process_id)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "infergate", self.role, "--id", process_id, *self.argv], env=env
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
        """Restart children that died, with exponential backoff."""
        now = time.monotonic()
        for child in self.children:
            if child.alive() or self.stopping:
                continue
            if child.next_start == 0.0:
                code = child.proc.returncode if child.proc else None
                backoff = min(0.5 * 2 ** min(child.restarts, 5), 10.0)
                if now - child.started_at > 30.0:
                    child.restarts = 0
                    backoff = 0.5
                child.next_start = now + backoff
                log.warning("up.child_died", child=child.name, exit_code=code, restart_in_s=backoff)
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


def run_stack(args: argparse.Namespace) -> int:
    logs.configure("up", "up")
    stop_requested: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop_requested.append(signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    tmp = Path(tempfile.mkdtemp(prefix="infergate-up-"))
    redis_server: RedisServer | None = None
    if args.policy:
        try:
            load_policy(args.policy)
        except PolicyError as exc:
            print(f"infergate up: the policy is not valid:\n{exc}", file=sys.stderr)
            return 2
        policy_path = str(Path(args.policy).resolve())
        if args.keys_out:
            print(
                "infergate up: --keys-out writes demo keys, and only without --policy; ignored",
                file=sys.stderr,
            )
    else:
        text, keys = demo_policy()
        policy_path = str(tmp / "demo-policy.yaml")
        Path(policy_path).write_text(text, "utf-8")
        print("infergate up: demo API keys (one per tier):", file=sys.stderr)
        for tier, secret in keys.items():
            print(f"  {tier:<10} {secret}", file=sys.stderr)
        if args.keys_out:
            Path(args.keys_out).write_text(json.dumps(keys, indent=2) + "\n", "utf-8")

    redis_url = os.environ.get("REDIS_URL")
    if not redis_url:
        try:
            redis_server = RedisServer().start()
        except RuntimeError as exc:
            print(f"infergate up: cannot start Redis: {exc}", file=sys.stderr)
            return 1
        redis_url = redis_server.url
        log.info("up.redis_started", url=redis_url)
    env = {**os.environ, "REDIS_URL": redis_url, "INFERGATE_NAMESPACE": args.namespace}

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
    children = [
        *(Child(f"worker-{i + 1}", "worker", worker_args) for i in range(args.workers)),
        *(
            Child(f"dispatcher-{i + 1}", "dispatcher", ["--policy", policy_path])
            for i in range(args.dispatchers)
        ),
        *(
            Child(
                f"gateway-{i + 1}",
                "gateway",
                ["--policy", policy_path, "--host", args.host, "--port", str(args.port)],
            )
            for i in range(args.gateways)
        ),
    ]
    stack = Stack(children, env)
    code = 0
    try:
        stack.start_all()
        ready_url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}/readyz"
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not _ready(ready_url):
            failed = stack.failed_child()
            if failed is not None:
                code_ = failed.proc.returncode if failed.proc else None
                print(
                    f"infergate up: {failed.name} failed to start (exit code {code_}); stopping",
                    file=sys.stderr,
                )
                return 1
            if stop_requested:
                return 0
            if time.monotonic() > deadline:
                print(
                    f"infergate up: not ready within {READY_TIMEOUT_S:.0f}s ({ready_url}); stopping",
                    file=sys.stderr,
                )
                return 1
            time.sleep(0.1)
        print(
            f"infergate up: ready at http://{args.host}:{args.port} "
            f"({args.gateways} gateway, {args.dispatchers} dispatcher, {args.workers} workers; Redis {redis_url})",
            file=sys.stderr,
        )
        while not stop_requested:
            stack.supervise_once()
            time.sleep(0.2)
        log.info("up.stopping", signal=stop_requested[0])
    except Exception:
        log.exception("up.failed")
        code = 1
    finally:
        stack.stop_all()
        if redis_server is not None:
            redis_server.stop()
    return code
