"""Serving the gateway with uvicorn on a SO_REUSEPORT socket, so several
gateway processes share one port and the kernel spreads connections."""

import socket

import uvicorn

from gateway.app import create_asgi
from gateway.service import Gateway


def reuseport_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


async def serve(gateway: Gateway, host: str, port: int, drain_timeout_s: float = 10.0) -> int:
    sock = reuseport_socket(host, port)
    config = uvicorn.Config(
        create_asgi(gateway),
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        log_config=None,
        timeout_graceful_shutdown=int(drain_timeout_s),
        backlog=2048,
    )
    server = uvicorn.Server(config)
    await server.serve(sockets=[sock])
    return 0 if server.started else 1
