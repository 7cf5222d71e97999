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
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from infergate.base import logs
from infergate.gateway.errors import ApiError

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


def content_length(value: bytes) -> int:
    """A Content-Length header's number (the HTTP parser checked its form;
    0 if it is not one). One too long to read, even zero-padded, is larger
    than any body limit."""
    digits = value.lstrip(b"0")
    if len(digits) > 18:
        return 1 << 62
    return int(digits) if digits.isdigit() else 0


class BodyRefused(Exception):
    def __init__(self, error: ApiError) -> None:
        super().__init__(error.message)
        self.error = error


class ClientLeft(Exception):
    """The client disconnected before its body arrived."""


# A route served without the app: (scope, body, receive, send); it sends every
# header itself, x-request-id (the scope's REQUEST_ID) included.
Direct = Callable[[Scope, bytes, Receive, Send], Awaitable[None]]


class RequestIdAndLimits:
    def __init__(
        self,
        app: ASGIApp,
        max_body_bytes: Callable[[], int],
        on_refused: Callable[[Scope, int], None] = lambda scope, status: None,
        direct: dict[tuple[str, str], Direct] | None = None,
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.on_refused = on_refused
        # (method, path) -> the handler that serves it instead of the app
        self.direct = direct or {}

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
        direct = self.direct.get((scope["method"], scope["path"]))
        if direct is not None:  # it sends the x-request-id header itself
            await direct(scope, body, receive, send)
            return
        await self.app(scope, _replay(body, receive), send_with_id)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        limit = self.max_body_bytes()
        too_large = ApiError("PAYLOAD_TOO_LARGE", f"the request body is over {limit} bytes")
        for name, value in scope["headers"]:
            if name == b"content-length":
                if content_length(value) > limit:
                    raise BodyRefused(too_large)
                break
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientLeft()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise BodyRefused(too_large)
            if not message.get("more_body", False):
                return chunk if not chunks else b"".join([*chunks, chunk])
            chunks.append(chunk)


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
    body = msgspec.json.encode(error.body(request_id))
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
        *((k.encode(), v.encode()) for k, v in error.all_headers().items()),
    ]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
