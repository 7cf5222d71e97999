"""Raw ASGI middleware around the Litestar app: the request id on every
response, one path per route, HEAD wherever GET, and the body's limits,
live.

A route has one path: one spelled otherwise (``//v1/admin/usage``,
``/v1//admin``, a trailing slash, ``/v1/%61dmin``, a dot segment) is 404,
so a proxy's rule on a path cannot be walked around. HEAD is answered as
GET is, without its body (load balancers probe with it).

The body is read here, whole, before the app sees it: at most the policy's
``limits.max_body_bytes`` (re-read for every request, so a live edit
applies at once, whether the body comes with a Content-Length or chunked).
Over it: 413 in the one error shape, connection closed. (How long a body
may take is the HTTP protocol's limit: ``edge.py``.) The app then reads the
same bytes back.
"""

import os
import re
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

        if not canonical(scope.get("raw_path") or b"/"):
            logs.limited(log, "request.refused", status=404, code="NOT_FOUND")
            error = ApiError("NOT_FOUND", "no such path (each route has one spelling)")
            await _send_error(send_with_id, error, request_id, close=False)
            return

        try:
            body = await self._read_body(scope, receive)
        except BodyRefused as exc:
            logs.limited(log, "request.refused", status=exc.error.status, code=exc.error.code)
            self.on_refused(scope, exc.error.status)
            await _send_error(send_with_id, exc.error, request_id)
            return
        except ClientLeft:
            return
        if scope["method"] == "HEAD":  # (answered as GET; uvicorn sends no body for HEAD)
            scope = {**scope, "method": "GET"}
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


# A percent-escape of one of these spells a path a second way: %61 is "a",
# %2F a slash, %2E a dot (the router decodes them; a proxy's rule may not).
_NEEDLESS_ESCAPES = re.compile(rb"%(?:[46][1-9A-Fa-f]|[57][0-9Aa]|3[0-9]|2[DEFdef]|5[Ff]|7[Ee])")


def canonical(raw_path: bytes) -> bool:
    """A path as its route spells it: no empty or dot segment, no trailing
    slash, no escape of a character that needs none (an id that needs one,
    such as a non-ASCII character, is its route's to refuse)."""
    if raw_path == b"/":
        return True
    return (
        raw_path.startswith(b"/")
        and not raw_path.endswith(b"/")
        and b"//" not in raw_path
        and b"/./" not in raw_path + b"/"
        and b"/../" not in raw_path + b"/"
        and (b"%" not in raw_path or _NEEDLESS_ESCAPES.search(raw_path) is None)
    )


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


async def _send_error(send: Send, error: ApiError, request_id: str, close: bool = True) -> None:
    status, headers, body = render(error, request_id)
    headers += [(b"content-length", b"%d" % len(body))]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
