"""Servers a remote backend calls, as real processes a test can start,
kill and start again on the same port: the team's batch endpoint
(``user_backends/batch_server.py``), and servers this project did not
write where they are installed (``.ci/upstreams`` makes their venvs)."""

import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from infergate.redis_server import free_port

from tests.helpers import wait_for

USER_CODE = Path(__file__).parent / "user_backends"
# Where .ci/upstreams puts the venvs of the servers it installs.
VENVS = Path(os.environ.get("INFERGATE_UPSTREAM_VENVS", "/opt/infergate-upstreams"))


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return int(resp.status) == 200
    except (urllib.error.URLError, OSError):
        return False


class Server:
    """One server process on a fixed port, with its log in a file."""

    def __init__(
        self,
        argv: Sequence[str],
        ready_path: str,
        log_path: Path,
        port: int | None = None,
        env: dict[str, str] | None = None,
        ready_timeout_s: float = 60.0,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [a.replace("{port}", str(self.port)) for a in argv]
        self.ready_url = self.url + ready_path
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> "Server":
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child holds it
        self.proc = subprocess.Popen(
            self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        log.close()

        def up() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(
                    f"{self.argv[:3]} exited:\n" + self.log_path.read_text()[-3000:]
                )
            return answers(self.ready_url)

        wait_for(up, self.ready_timeout_s, f"{self.ready_url} to answer")
        return self

    def kill(self) -> None:
        """SIGKILL, as a crash (every process of its session)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def batch_server(log_dir: Path, port: int | None = None) -> Server:
    """The team's batch endpoint (``http:`` contract) on a free port."""
    return Server(
        [sys.executable, str(USER_CODE / "batch_server.py"), "{port}"],
        "/health",
        log_dir / "batch-server.log",
        port,
    )
