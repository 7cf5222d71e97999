"""Every process's side port (``--metrics-port``): ``/metrics`` for
Prometheus, and ``/healthz`` and ``/readyz`` for an orchestrator's probes
(a dispatcher or a worker has no HTTP port of its own).

- ``/healthz``: the process is alive: its event loop still runs its loops
  (a loop that keeps failing because Redis is away is still alive: a
  restart would not bring Redis back). Wire the liveness probe here.
- ``/readyz``: it does its job now: its heartbeat reaches Redis and it is
  not draining. Wire the readiness probe here.

Served on a thread of its own, so a probe is answered while the event loop
is busy; the answers read flags the event loop keeps.
"""

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app


@dataclass(frozen=True)
class Probes:
    alive: Callable[[], bool]
    ready: Callable[[], bool]


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    # A connection that sends nothing for this long is closed (one thread each).
    timeout = 5

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes and probes every few seconds are not news."""


def _app(registry: CollectorRegistry, probes: Probes) -> Callable[..., Iterable[bytes]]:
    metrics = make_wsgi_app(registry)
    checks = {"/healthz": probes.alive, "/readyz": probes.ready}

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return metrics(environ, start_response)  # type: ignore[no-any-return]
        check = checks.get(path)
        ok = check is not None and check()
        status = "200 OK" if ok else "404 Not Found" if check is None else "503 Service Unavailable"
        body = b'{"status":"ok"}' if ok else b'{"status":"unavailable"}'
        if check is None:
            body = b'{"status":"not found: /metrics, /healthz or /readyz"}'
        start_response(
            status, [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
        )
        return [] if environ.get("REQUEST_METHOD") == "HEAD" else [body]

    return app


def serve(
    registry: CollectorRegistry, probes: Probes, port: int, host: str = "127.0.0.1"
) -> Callable[[], None]:
    """Serve the side port on its own thread; returns the function that stops it."""
    server = make_server(host, port, _app(registry, probes), _Server, _QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="side-port", daemon=True)
    thread.start()

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=2)

    return stop
