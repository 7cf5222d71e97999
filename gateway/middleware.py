"""Raw ASGI middleware around the Litestar app: the request id on every
response, and the body's limits, live.

The body is read here, whole, before the app sees it: at most the policy's
``limits.max_body_bytes`` (re-read for every request, so a live edit
applies at once, whether the body comes with a Content-Length or chunked).
Over it: 413 in the one error shape, connection closed. (How long a body
may take is the HTTP protocol's limit: ``edge.py``.) The app then reads the
same bytes back.
"""

import os
from collections.abc import Callable
from typing import Any

from infergate.base import logs
from infergate.gateway.errors import ApiError, render
from infergate.gateway.limits import Body

Scope = dict[str, Any]
Receive = Callable[[], Any]
Send = Callable[[dict[str, Any]], Any]
ASGIApp = Any  # Litestar's own, stricter ASGI types do not unify with these

REQUEST_ID = "infergate.request_id"
# The edge's disconnect hook (``service.OnDisconnect``), in each request's scope.
ON_DISCONNECT = "infergate.on_disconnect"

log = logs.get(__name__)


def new_request_id() -> str:
    return os.urandom(8).hex()


class BodyRefused(Exception):
    def __init__(self, error: ApiError) -> None:
        super().__init__(error.message)
        self.error = error


class ClientLeft(Exception):
    """The client disconnected before its body arrived."""


class RequestIdAndLimits:
    def __init__(
        self,
        app: ASGIApp,
        max_body_bytes: Callable[[], int],
        on_refused: Callable[[Scope, int], None] = lambda scope, status: None,
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = new_request_id()
        scope[REQUEST_ID] = request_id
        header = (b"x-request-id", request_id.encode())

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), header]
            await send(message)

        try:
            body = await self._read_body(scope, receive)
        except BodyRefused as exc:
            logs.limited(log, "request.refused", status=exc.error.status, code=exc.error.code)
            self.on_refused(scope, exc.error.status)
            await _send_error(send_with_id, exc.error, request_id)
            return
        except ClientLeft:
            return
        await self.app(scope, _replay(body, receive), send_with_id)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        body = Body(self.max_body_bytes(), scope["headers"])
        while not body.too_large:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientLeft()
            body.add(message.get("body", b""))
            if not message.get("more_body", False) and not body.too_large:
                return body.whole()
        raise BodyRefused(body.error())


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the app the body read above, then the client's own
    messages (its disconnect, which the gateway watches for)."""
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        message: dict[str, Any] = await receive()
        return message

    return replay


async def _send_error(send: Send, error: ApiError, request_id: str) -> None:
    status, headers, body = render(error, request_id)
    headers += [(b"content-length", b"%d" % len(body)), (b"connection", b"close")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
