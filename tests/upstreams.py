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

from infergate.base.ports import free_port

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


def _venv_python(name: str) -> Path | None:
    python = VENVS / name / "bin" / "python"
    return python if python.exists() else None


def triton_python() -> Path | None:
    """The venv of PyTriton (.ci/upstreams), if it is installed here."""
    return _venv_python("triton")


def openai_python() -> Path | None:
    """The venv of `transformers serve` (.ci/upstreams), if it is installed here."""
    return _venv_python("openai")


def triton_server(log_dir: Path, port: int | None = None) -> Server:
    """Triton with ``user_backends/triton_echo.py``'s models (HTTP on ``port``,
    gRPC and metrics on the two after it)."""
    python = triton_python()
    assert python is not None
    port = port or _three_free_ports()
    libdir = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return Server(
        [str(python), str(USER_CODE / "triton_echo.py"), "{port}"],
        "/v2/models/echo_raw/ready",
        log_dir / "triton.log",
        port,
        env={"LD_LIBRARY_PATH": libdir},
        ready_timeout_s=120,
    )


def _three_free_ports() -> int:
    """A port whose next two are free too (Triton's gRPC and metrics)."""
    for _ in range(50):
        port = free_port()
        if port < 65000 and all(_free(port + i) for i in (1, 2)):
            return port
    raise AssertionError("no three free ports in a row")


def _free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def tiny_model(directory: Path) -> Path:
    """The project's tiny GPT-2 (``gpu/tiny_model.py``), built with the
    openai venv's torch (the project's venv may have none), with room for
    a worker's warm-up inputs."""
    python = openai_python()
    assert python is not None
    if not (directory / "config.json").exists():
        builder = Path(__file__).parent.parent / "gpu" / "tiny_model.py"
        subprocess.run(
            [
                str(python),
                "-c",
                "import runpy, sys, pathlib;"
                f"runpy.run_path({str(builder)!r})['build_tiny_gpt2'](pathlib.Path(sys.argv[1]), n_positions=2048)",
                str(directory),
            ],
            check=True,
            capture_output=True,
            timeout=300,
        )
    return directory


def transformers_server(log_dir: Path, model_dir: Path, port: int | None = None) -> Server:
    """``transformers serve`` (OpenAI-compatible, on the CPU) with ``model_dir``."""
    python = openai_python()
    assert python is not None
    return Server(
        [
            str(python.parent / "transformers"),
            "serve",
            str(model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            "{port}",
            "--device",
            "cpu",
        ],
        "/v1/models",
        log_dir / "transformers-serve.log",
        port,
        env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        ready_timeout_s=180,
    )


def completions_server(log_dir: Path, port: int | None = None) -> Server:
    """An OpenAI-compatible server that takes lists of prompts (vLLM's wire)."""
    return Server(
        [sys.executable, str(USER_CODE / "completions_server.py"), "{port}"],
        "/v1/models",
        log_dir / "completions-server.log",
        port,
    )
