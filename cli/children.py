"""The child processes of ``infergate up``: each started as ``python -m
infergate <role>`` in a session of its own, restarted with backoff when it
dies (at once after a long life), retired on purpose by SIGTERM, and all
stopped together (SIGTERM, then SIGKILL past a bound)."""

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from infergate.base import logs
from infergate.base.loops import Backoff

log = logs.get(__name__)

# Longer than any child's drain: a gateway's 10 s, a worker's hang timeout + 10 s.
STOP_TIMEOUT_S = 25.0
CHILD_STABLE_S = 30.0  # a child that lived this long restarts without waiting


@dataclass
class Child:
    name: str
    role: str
    argv: list[str]
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    next_start: float = 0.0
    started_at: float = 0.0
    slot: int = 0  # a worker's place: its GPU and metrics port follow from it
    retiring: bool = False  # stopped on purpose (scaled down): not restarted
    # Extra environment for this child alone (a worker's CUDA_VISIBLE_DEVICES).
    env: dict[str, str] = field(default_factory=dict)
    backoff: Backoff = field(default_factory=lambda: Backoff(base_s=0.5, cap_s=10.0))

    def start(self, env: dict[str, str]) -> None:
        process_id = f"{self.name}-{os.urandom(3).hex()}"
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

    def workers(self) -> list[Child]:
        """The workers running or restarting, not those being retired."""
        return [c for c in self.children if c.role == "worker" and not c.retiring]

    def add(self, child: Child) -> None:
        self.children.append(child)
        child.start(self.env)

    def retire(self, child: Child) -> None:
        """Stop a child for good by SIGTERM (a worker drains its batch first)."""
        child.retiring = True
        if child.alive() and child.proc is not None:
            child.proc.send_signal(signal.SIGTERM)

    def supervise_once(self) -> None:
        """Restart children that died, with backoff (reset after a long life);
        forget retired ones once they have exited."""
        now = time.monotonic()
        self.children = [c for c in self.children if not (c.retiring and not c.alive())]
        for child in self.children:
            if child.alive() or self.stopping or child.retiring:
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
            if child.alive() and child.proc is not None and not child.retiring:
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
