"""Replies read straight from a connection redis-py opened.

redis-py opens the connection (address, Sentinel, TLS, AUTH, db, client
name, as configured); what goes through it afterwards on the hot paths (the
pipelined script calls, the reply channel) is read here, from its stream,
with one hiredis reader: no pool, lock, timeout context or hook per reply.
An error reply comes back as the exception redis-py would raise for it.
"""

import asyncio
from typing import Any

import hiredis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import (
    BusyLoadingError,
    InvalidResponse,
    NoScriptError,
    ReadOnlyError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

# Redis's error prefixes that mean something to the code around (``errors.py``).
_ERRORS: dict[str, type[Exception]] = {
    "NOSCRIPT": NoScriptError,
    "READONLY": ReadOnlyError,
    "LOADING": BusyLoadingError,
}


def _error(reply: ResponseError) -> Exception:
    message = str(reply)
    return _ERRORS.get(message.split(" ", 1)[0], ResponseError)(message)


class RawConnection:
    """An open redis-py connection, written and read directly."""

    def __init__(self, connection: AbstractConnection) -> None:
        self.connection = connection
        stream, writer = connection._reader, connection._writer
        if stream is None or writer is None:
            raise RedisConnectionError("the connection is not open")
        self.stream = stream
        self.writer = writer
        self.parser = hiredis.Reader(protocolError=InvalidResponse, replyError=ResponseError)
        self.timed_out = False

    def write(self, data: bytes) -> None:
        self.writer.write(data)

    async def replies(self, n: int, timeout_s: float | None) -> list[Any]:
        """The next ``n`` replies, in order (an error reply as its exception).
        One timer for all of them: past ``timeout_s`` the connection is cut
        and this raises, as redis-py's socket timeout would."""
        out: list[Any] = []
        timer = None
        try:
            while len(out) < n:
                reply = self.parser.gets()
                if reply is not False:
                    out.append(_error(reply) if isinstance(reply, ResponseError) else reply)
                    continue
                if timer is None and timeout_s is not None:
                    timer = asyncio.get_running_loop().call_later(timeout_s, self._time_out)
                await self._read()
        finally:
            if timer is not None:
                timer.cancel()
        return out

    async def next_push(self, timeout_s: float) -> Any:
        """The next message pushed on a subscribed connection, or None if
        none came within ``timeout_s`` (the connection stays as it was)."""
        reply = self.parser.gets()
        if reply is False:
            try:
                async with asyncio.timeout(timeout_s):
                    while reply is False:
                        await self._read()
                        reply = self.parser.gets()
            except TimeoutError:
                return None
        return _error(reply) if isinstance(reply, ResponseError) else reply

    async def _read(self) -> None:
        data = await self.stream.read(65536)
        if not data:
            if self.timed_out:
                raise RedisTimeoutError("Timeout reading from Redis")
            raise RedisConnectionError("Connection closed by server.")
        self.parser.feed(data)

    def _time_out(self) -> None:
        self.timed_out = True
        self.writer.transport.abort()
