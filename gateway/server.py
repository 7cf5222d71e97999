"""Serving the gateway with uvicorn on a SO_REUSEPORT socket, so several
gateway processes share one port and the kernel spreads connections.

Drain: the first SIGTERM/SIGINT/SIGHUP makes the gateway refuse new
requests (503, ``/readyz`` not ready) while it waits, up to the drain
timeout, for the requests it is holding; then uvicorn shuts down. A second
SIGTERM or SIGINT ends it at once.
"""

import asyncio
import contextlib
import signal
import socket
import threading
from collections.abc import Iterator
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn
from infergate.base import clock, logs, runtime
from infergate.gateway.app import create_asgi, fast_routes
from infergate.gateway.edge import EdgeProtocol
from infergate.gateway.edge_contract import quiet_parser_warnings, self_test
from infergate.gateway.inference import Inference
from infergate.gateway.limits import EdgeLimits
from infergate.gateway.service import Gateway

if TYPE_CHECKING:
    from infergate.gateway.grpc_server import GrpcServer

log = logs.get(__name__)


def reuseport_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


async def serve(
    gateway: Gateway,
    sock: socket.socket,
    drain_timeout_s: float = 10.0,
    limits: EdgeLimits | None = None,
    grpc_port: int = 0,
) -> int:
    """Serve on ``sock`` (from ``reuseport_socket``, bound before the event
    loop starts, so a busy port is a message, not a traceback), and the
    gRPC API on ``grpc_port`` too (0: not)."""
    limits = limits or EdgeLimits()
    broken = await self_test()
    if broken is not None:
        # This uvicorn is not one the edge was tested on (pyproject.toml's range).
        log.error("gateway.edge_broken", cause=broken, uvicorn=uvicorn.__version__)
        return 1
    quiet_parser_warnings()
    # The gateway's state, its request path, and the two ways in: the edge's
    # fast routes and the Litestar app (every other route).
    inference = Inference(gateway)
    config = uvicorn.Config(
        create_asgi(gateway, inference),
        loop="uvloop",
        # No route is a websocket: an upgrade is an ordinary request (uvicorn's
        # websocket protocol would take the connection out of the edge's limits).
        ws="none",
        http=EdgeProtocol.with_limits(limits, *fast_routes(gateway, inference)),
        timeout_keep_alive=max(1, round(limits.keep_alive_s)),
        lifespan="on",
        access_log=False,
        # Nothing reads the client's address: no X-Forwarded-* rewriting per request.
        proxy_headers=False,
        log_config=None,
        timeout_graceful_shutdown=int(drain_timeout_s),
        backlog=2048,
    )
    grpc = _grpc_server(inference, sock, limits, grpc_port) if grpc_port else None
    runtime.freeze_heap()  # (the app is built: a collection scans only what serving makes)
    server = DrainingServer(config, gateway, drain_timeout_s, grpc)
    await server.serve(sockets=[sock])
    if server.grpc_failed:
        return 2
    return 0 if server.started else 1


def _grpc_server(
    inference: Inference, sock: socket.socket, limits: EdgeLimits, port: int
) -> "GrpcServer":
    """The gRPC API (imported only where it is asked for)."""
    from infergate.gateway.grpc_server import GrpcServer

    host = sock.getsockname()[0]
    max_bytes = inference.gw.policy.current.document.limits.max_body_bytes
    return GrpcServer(inference, host, port, limits, max_bytes)


class DrainingServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        gateway: Gateway,
        drain_timeout_s: float,
        grpc: "GrpcServer | None" = None,
    ) -> None:
        super().__init__(config)
        self.gateway = gateway
        # The gRPC port: open once the gateway has started, as HTTP's is,
        # and closed before it stops (its calls drained with HTTP's).
        self.grpc = grpc
        self.grpc_failed = False
        self.drain_timeout_s = drain_timeout_s
        self.drain_started: float | None = None
        self._signalled: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.grpc is None or self.should_exit:
            return
        try:
            await self.grpc.start()
        except OSError as exc:
            log.error("grpc.cannot_listen", error=str(exc))
            self.grpc, self.grpc_failed, self.should_exit = None, True, True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.grpc is not None:
            await self.grpc.stop(1.0)
        await super().shutdown(sockets)

    async def main_loop(self) -> None:
        """uvicorn's ticks, once a second rather than ten times (the Date
        header's resolution; a process at rest wakes for little else), ten
        a second while draining; a signal ends the wait at once."""
        signalled = asyncio.Event()
        self._signalled = (asyncio.get_running_loop(), signalled)
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            step = 1 if self.drain_started is not None else 10  # (tenths of a second)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(signalled.wait(), step / 10)
            signalled.clear()
            counter = (counter + step) % 864000
            should_exit = await self.on_tick(counter)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's (SIGINT, SIGTERM), and SIGHUP, the same drain."""
        if (
            threading.current_thread() is not threading.main_thread()
            or signal.SIGHUP not in runtime.stop_signals()
        ):
            with super().capture_signals():
                yield
            return
        previous = signal.signal(signal.SIGHUP, self.handle_exit)
        try:
            with super().capture_signals():
                yield
        finally:
            signal.signal(signal.SIGHUP, previous)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._signalled is not None:  # (a signal handler: the loop is woken safely)
            loop, signalled = self._signalled
            with contextlib.suppress(RuntimeError):  # (a loop already closed)
                loop.call_soon_threadsafe(signalled.set)
        if self.drain_started is None and sig in runtime.STOP_SIGNALS:
            self.drain_started = clock.monotonic_s()
            self.gateway.draining = True
            log.info("gateway.draining", pending=len(self.gateway.replies.pending))
            return
        if sig == signal.SIGHUP:
            return  # (a closed terminal may send it twice: the drain goes on)
        self.should_exit = True
        self.force_exit = self.force_exit or self.drain_started is not None

    async def on_tick(self, counter: int) -> bool:
        if self.drain_started is not None and not self.should_exit:
            pending = len(self.gateway.replies.pending)
            waited = clock.monotonic_s() - self.drain_started
            if pending == 0 or waited > self.drain_timeout_s:
                log.info("gateway.drained", pending=pending, waited_s=round(waited, 2))
                self.should_exit = True
        return await super().on_tick(counter)
