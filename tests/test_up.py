"""``infergate up`` as a newcomer meets it: what cannot work is said before
anything starts (no Redis, no demo keys written), the ready line counts
what it started, the wait for a stack outlasts a worker that warms up
slowly, and ``--workers 0`` prints the command a GPU host runs to join."""

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from infergate.base.ports import free_port
from infergate.redis_server import RedisServer

from tests.helpers import ask_with_demo_key, wait_for
from tests.upstreams import USER_CODE, answers

EXAMPLE = Path(__file__).parent.parent / "policies" / "example.yaml"


class Up:
    """``infergate up`` in ``tmp_path``, its stderr (and its children's) in a file."""

    def __init__(self, tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> None:
        base = {
            k: v
            for k, v in os.environ.items()
            if k != "REDIS_URL" and not k.startswith("INFERGATE_")
        }
        self.log_path = tmp_path / f"up-{free_port()}.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "infergate", "up", *args],
                env={**base, "INFERGATE_LOG_FORMAT": "json", **(env or {})},
                stdout=subprocess.DEVNULL,
                stderr=log,
                cwd=tmp_path,
                start_new_session=True,
            )

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout_s: float = 30) -> int:
        return self.proc.wait(timeout_s)

    def ready(self, url: str) -> bool:
        """Whether ``url`` answers 200; the test fails at once if up exited."""
        if self.proc.poll() is not None:
            raise AssertionError("up exited:\n" + self.output()[-3000:])
        return answers(url)

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(40)
        return self.output()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--backend", "mymodel:fn"], "--backend: 'mymodel:fn' is not a backend"),
        (
            ["--backend", "http:http://x/infer", "--backend-options", "{colour: red}"],
            "'colour' is not an option of http",
        ),
        (
            ["--backend", "simulated", "--concurrency", "2"],
            "the simulated backend runs one batch at a time",
        ),
        (["--concurrency", "0"], "--concurrency must be 1-"),
        (["--sim-new-token-weight", "0.5"], "new_token_weight must be 1-1000"),
        (["--sim-step-weight", "-1"], "step_weight must be 0-1000"),
    ],
)
def test_what_cannot_work_is_said_before_anything_starts(
    tmp_path: Path, args: list[str], says: str
) -> None:
    up = Up(tmp_path, "--port", str(free_port()), "--keys-out", "keys.json", *args)
    assert up.wait() == 2
    err = up.output()
    assert says in err
    assert "demo API keys" not in err
    assert not (tmp_path / "keys.json").exists()


def test_a_busy_port_is_said_before_anything_starts(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        up = Up(tmp_path, "--port", str(port), "--keys-out", "keys.json")
        assert up.wait() == 2
    assert f"cannot listen on 127.0.0.1:{port}" in up.output()
    assert not (tmp_path / "keys.json").exists()


def test_the_ready_line_counts_what_started(tmp_path: Path) -> None:
    port = free_port()
    up = Up(tmp_path, "--port", str(port), "--models", "small=1,large=2", "--sim-latency-ms", "20")
    try:
        wait_for(lambda: up.ready(f"http://127.0.0.1:{port}/readyz"), 60, "up")
    finally:
        err = up.stop()
    line = next(line for line in err.splitlines() if "infergate up: ready at" in line)
    assert "(1 gateway, 2 dispatchers, models small (1 worker), large (2 workers);" in line


def test_the_wait_outlasts_a_worker_that_warms_up_slowly(tmp_path: Path) -> None:
    """A model that loads for 6 s, with --ready-timeout-s 2: up waits, since
    the worker says it is warming up, and serves."""
    port = free_port()
    up = Up(
        tmp_path,
        "--port", str(port), "--workers", "1", "--ready-timeout-s", "2",
        "--backend", "python:fixture_model:SlowToLoad", "--backend-options", "{load_s: 6}",
        env={"PYTHONPATH": str(USER_CODE)},
    )  # fmt: skip
    try:
        wait_for(lambda: up.ready(f"http://127.0.0.1:{port}/readyz"), 60, "up")
    finally:
        err = up.stop()
    assert "infergate up: ready at" in err, err[-2000:]


def test_the_workers_run_the_policy_s_backend_without_a_flag(tmp_path: Path) -> None:
    """A policy whose model names the team's code: up's workers run it
    (before, up's default --backend simulated overrode it)."""
    example = EXAMPLE.read_text("utf-8")  # less its keys: up adds demo ones
    unkeyed = example[: example.index("\nkeys:\n")] + example[example.index("\nbatching:") :]
    (tmp_path / "policy.yaml").write_text(
        unkeyed + "\nmodels:\n  default: {backend: 'python:fixture_model:batchstring'}\n", "utf-8"
    )
    port = free_port()
    up = Up(
        tmp_path, "--port", str(port), "--workers", "1", "--policy", "policy.yaml",
        "--keys-out", "keys.json", env={"PYTHONPATH": str(USER_CODE)},
    )  # fmt: skip
    try:
        wait_for(lambda: up.ready(f"http://127.0.0.1:{port}/readyz"), 60, "up")
        status, body = ask_with_demo_key(tmp_path / "keys.json", port, "mine")
        assert (status, body.get("output")) == (200, "fn:mine"), body
    finally:
        up.stop()


def test_workers_elsewhere_join_with_the_printed_command(tmp_path: Path) -> None:
    """``up --workers 0`` runs all but the workers and prints the command a
    GPU host runs; run as printed, a worker joins and serves."""
    redis_server = RedisServer().start()
    port = free_port()
    up = Up(
        tmp_path, "--port", str(port), "--workers", "0", "--keys-out", "keys.json",
        env={"REDIS_URL": redis_server.url},
    )  # fmt: skip
    worker = None
    try:

        def printed() -> str | None:
            up.ready(f"http://127.0.0.1:{port}/healthz")
            lines = [line for line in up.output().splitlines() if line.startswith("  REDIS_URL=")]
            return lines[0].strip() if lines else None

        command = wait_for(printed, 60, "the command to join")
        # (no --backend: the worker runs its model's, as the policy says)
        assert re.search(r"infergate worker( |$)", command), command
        assert "--backend" not in command, command
        local = command.replace("infergate worker", f"{sys.executable} -m infergate worker", 1)
        worker = subprocess.Popen(
            ["bash", "-c", local],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for(lambda: up.ready(f"http://127.0.0.1:{port}/readyz"), 60, "the worker to join")
        status, body = ask_with_demo_key(tmp_path / "keys.json", port, "joined")
        assert status == 200, body
        assert body["output"].endswith("joined")
    finally:
        if worker is not None:
            worker.terminate()
            worker.wait(30)
        up.stop()
        redis_server.close()
