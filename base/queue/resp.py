"""Replies read straight from a connection redis-py opened.

redis-py opens the connection (address, Sentinel, TLS, AUTH, db, client
name, protocol, as configured); what goes through it afterwards on the hot
paths (the pipelined script calls, the reply channel) is read here, from its
stream, with one hiredis reader: no pool, lock, timeout context or hook per
reply. An error reply comes back as the exception redis-py would raise for
it. A push the server sends on its own (RESP3 maintenance notices, on Redis
Cloud or Software) is skipped on the pipelined connection: redis-py would
relax its timeouts or reconnect on one, this one does not; a server that
then closes the connection is noticed before the next write.
"""

import asyncio
from collections.abc import Callable
from typing import Any

import hiredis
from redis._parsers import BaseParser
from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

# What the reader returns while a reply is incomplete (False is a RESP3 value).
_MORE = object()

# The internals of redis-py's connection read here (pyproject.toml bounds
# redis-py to the versions tested with them).
CONNECTION_INTERNALS = ("_reader", "_writer")


class RedisInternalsMoved(RuntimeError):
    """This redis-py no longer has an internal this module reads: a bug of
    the installation (a redis-py outside pyproject.toml's range), not of Redis."""


def error_of(reply: ResponseError) -> Exception:
    """The exception redis-py raises for an error reply."""
    error: Exception = BaseParser.parse_error(str(reply))  # type: ignore[no-untyped-call]
    return error


class RawConnection:
    """An open redis-py connection, written and read directly."""

    def __init__(self, connection: AbstractConnection) -> None:
        self.connection = connection
        missing = [name for name in CONNECTION_INTERNALS if not hasattr(connection, name)]
        if missing:
            raise RedisInternalsMoved(
                f"redis-py's {type(connection).__name__} has no {', '.join(missing)}: "
                "install a redis-py within pyproject.toml's range"
            )
        stream, writer = connection._reader, connection._writer
        if stream is None or writer is None:
            raise RedisConnectionError("the connection is not open")
        self.stream = stream
        self.writer = writer
        self.parser = hiredis.Reader(
            protocolError=InvalidResponse, replyError=ResponseError, notEnoughData=_MORE
        )
        self.timed_out = False

    def usable(self) -> bool:
        """Still open, not cut by a timeout, not closed by the server."""
        # (``at_eof`` waits for the buffer to be read: the end itself is enough.)
        ended = self.stream.at_eof() or bool(getattr(self.stream, "_eof", False))
        return not (self.timed_out or self.writer.is_closing() or ended)

    def write(self, data: bytes) -> None:
        self.writer.write(data)

    async def replies(
        self, n: int, timeout_s: float | None, each: Callable[[int, Any], None]
    ) -> None:
        """Hand the next ``n`` replies, in order, to ``each(i, reply)`` as they
        arrive (an error reply as its exception). One timer for all of them:
        past ``timeout_s`` the connection is cut and this raises, as
        redis-py's socket timeout would; the replies already handed stay so."""
        timer = None
        i = 0
        try:
            while i < n:
                reply = self.parser.gets()
                if reply is _MORE:
                    if timer is None and timeout_s is not None:
                        timer = asyncio.get_running_loop().call_later(timeout_s, self._time_out)
                    await self._read()
                elif not isinstance(reply, hiredis.PushNotification):
                    each(i, error_of(reply) if isinstance(reply, ResponseError) else reply)
                    i += 1
        finally:
            if timer is not None:
                timer.cancel()

    async def next_push(self, timeout_s: float) -> Any:
        """The next message on a subscribed connection, or None if none came
        within ``timeout_s`` (the connection stays as it was)."""
        reply = self.parser.gets()
        if reply is _MORE:
            try:
                async with asyncio.timeout(timeout_s):
                    while reply is _MORE:
                        await self._read()
                        reply = self.parser.gets()
            except TimeoutError:
                return None
        return error_of(reply) if isinstance(reply, ResponseError) else reply

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


async def hold(redis: Redis) -> RawConnection:
    """A connection of the client's pool, open, held until ``let_go``."""
    pool = redis.connection_pool
    connection = await pool.get_connection()  # type: ignore[no-untyped-call]
    try:
        link = RawConnection(connection)
        if not link.usable():  # an idle one of the pool's, from before a restart
            await connection.disconnect()
            await connection.connect()
            link = RawConnection(connection)
    except BaseException:
        try:
            await connection.disconnect()
        finally:
            await pool.release(connection)
        raise
    return link


async def let_go(redis: Redis, link: RawConnection) -> None:
    """Close a held connection and give it back to the pool."""
    try:
        await link.connection.disconnect()
    finally:
        await redis.connection_pool.release(link.connection)
