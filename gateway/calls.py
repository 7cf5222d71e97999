"""One call of an inference route as the HTTP layer hands it over: who sent
it (its one Authorization header), its body, its trace context, and the hook
that says when its client has gone.
"""

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from infergate.gateway.api import InferenceRequest
from infergate.gateway.auth import SEVERAL_AUTHORIZATIONS
from infergate.gateway.errors import Headers

if TYPE_CHECKING:
    from infergate.gateway.prompt_lists import ListCharge

# Registers what to run if the client disconnects while its request waits
# (None clears it). The HTTP edge runs it from the connection's loss: no task
# per request reading the connection for a disconnect.
OnDisconnect = Callable[[Callable[[], None] | None], None]


@dataclass(frozen=True)
class Call:
    request_id: str
    authorization: str | None
    body: bytes
    on_disconnect: OnDisconnect | None = None
    # W3C trace context from the caller (used only when tracing is on).
    traceparent: str | None = None
    tracestate: str | None = None
    # A route that read its own body (the OpenAI routes) hands it over read,
    # and may ask for the input's tokens to be counted.
    request: InferenceRequest | None = None
    count_input: bool = False
    # Its key's hold on a connection is taken already (one per call of several prompts).
    held: bool = False
    # One of a list of prompts: the list's quota, charged for it already.
    charged: "ListCharge | None" = None
    # A chat's messages as JSON (``openai_api.Ask``), for the backend.
    conversation: str | None = None


def call_from(
    request_id: str, headers: Headers, body: bytes, on_disconnect: OnDisconnect | None
) -> Call:
    """A call from its raw headers: several Authorization headers are one
    refused credential (``SEVERAL_AUTHORIZATIONS``)."""
    authorization = traceparent = tracestate = None
    for name, value in headers:
        if name == b"authorization":
            if authorization is None:
                authorization = value.decode("latin-1")
            else:
                authorization = SEVERAL_AUTHORIZATIONS
        elif name == b"traceparent":
            traceparent = value.decode("latin-1")
        elif name == b"tracestate":
            tracestate = value.decode("latin-1")
    return Call(request_id, authorization, body, on_disconnect, traceparent, tracestate)


class Fanout:
    """One connection's disconnect hook shared by the several requests of
    one call (a list of prompts): the hook has one slot, so this takes it
    once and tells every request that still waits."""

    def __init__(self, hook: OnDisconnect) -> None:
        self._hook = hook
        self._waiting: dict[int, Callable[[], None]] = {}
        self._gone = False
        hook(self._lost)

    def _lost(self) -> None:
        self._gone = True
        for callback in list(self._waiting.values()):
            callback()

    def hook_of(self, i: int) -> OnDisconnect:
        """Request ``i``'s hook: one that registers after the client has
        gone is told at once (as the edge tells a single request)."""

        def register(callback: Callable[[], None] | None) -> None:
            if callback is None:
                self._waiting.pop(i, None)
            elif self._gone:
                asyncio.get_running_loop().call_soon(callback)
            else:
                self._waiting[i] = callback

        return register

    def close(self) -> None:
        self._hook(None)
