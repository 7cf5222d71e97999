"""Raw ASGI middleware around the Litestar app: the request id on every
response, and the body-size limit before a byte of the body is read."""

import os
from collections.abc import Callable
from typing import Any

import msgspec
from infergate.gateway.errors import ApiError

Scope = dict[str, Any]
Receive = Callable[[], Any]
Send = Callable[[dict[str, Any]], Any]
ASGIApp = Any  # Litestar's own, stricter ASGI types do not unify with these

REQUEST_ID = "infergate.request_id"


def new_request_id() -> str:
    return os.urandom(8).hex()


class RequestIdAndLimits:
    def __init__(self, app: ASGIApp, max_body_bytes: Callable[[], int]) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

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

        limit = self.max_body_bytes()
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    too_large = int(value) > limit
                except ValueError:
                    too_large = False
                if too_large:
                    await _send_error(
                        send_with_id,
                        ApiError("PAYLOAD_TOO_LARGE", f"the request body is over {limit} bytes"),
                        request_id,
                    )
                    return
                break
        await self.app(scope, receive, send_with_id)


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
