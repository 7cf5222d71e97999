"""Script calls of many concurrent requests, written to Redis together.

redis-py spends more CPU on one command's way through its client (a
connection taken from the pool and given back under a lock, retries,
observability hooks) than Redis spends running it. On the gateway's hot
path every request makes one call (``admit.lua``), so the calls are queued
here and sent by one flushing task (packed by hiredis, in C): whatever is queued goes out as one write
on one connection, its replies are read in order, and what arrives during
that round trip goes out in the next. Under load the batches grow by
themselves; alone, a call goes out at once.

Nothing is re-sent after an error, as everywhere (``store.connect``): a
call whose reply was lost fails with the connection's error. The one
exception is NOSCRIPT (a restarted or failed-over Redis has no scripts):
Redis refused those calls without running them, so they are sent once more
after the script is loaded.
"""

import asyncio
from typing import Any

from hiredis import pack_command
from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError


class _Call:
    __slots__ = ("command", "future", "resent", "script")

    def __init__(
        self, script: AsyncScript, command: tuple[Any, ...], future: "asyncio.Future[Any]"
    ) -> None:
        self.script = script
        self.command = command
        self.future = future
        self.resent = False

    def settle(self, reply: Any = None, exc: BaseException | None = None) -> None:
        if self.future.done():  # its caller gave up (cancelled)
            return
        if exc is not None:
            self.future.set_exception(exc)
        else:
            self.future.set_result(reply)


class Pipelined:
    """Queued script calls on one client, flushed a batch per round trip."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self._queued: list[_Call] = []
        self._flusher: asyncio.Task[None] | None = None

    def call(self, script: AsyncScript, keys: list[str], args: list[Any]) -> "asyncio.Future[Any]":
        """EVALSHA ``script`` with ``keys`` and ``args``; the future gets its reply."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queued.append(_Call(script, ("EVALSHA", script.sha, len(keys), *keys, *args), future))
        if self._flusher is None:
            self._flusher = asyncio.ensure_future(self._flush())
        return future

    async def _flush(self) -> None:
        try:
            while self._queued:
                batch, self._queued = self._queued, []
                try:
                    await self._send(batch)
                except BaseException as exc:
                    _fail(batch, exc)
                    if isinstance(exc, asyncio.CancelledError):
                        raise
        finally:
            self._flusher = None
            # Cancelled (the process stops): nothing queued is left waiting.
            _fail(self._queued, RedisConnectionError("the Redis client is closing"))
            self._queued = []

    async def _send(self, batch: list[_Call]) -> None:
        """One write, then the replies in order. A connection error fails
        every call of the batch not yet answered (the caller fails them)."""
        pool = self.redis.connection_pool
        connection = await pool.get_connection()  # type: ignore[no-untyped-call]
        missing: list[_Call] = []
        try:
            await connection.send_packed_command(b"".join(pack_command(c.command) for c in batch))
            for call in batch:
                try:
                    call.settle(await connection.read_response())
                except NoScriptError as exc:
                    if call.resent:
                        call.settle(exc=exc)
                    else:
                        missing.append(call)
                except ResponseError as exc:  # this call's own error (the script's)
                    call.settle(exc=exc)
        except BaseException:
            await connection.disconnect()
            raise
        finally:
            await pool.release(connection)
        if missing:
            for script in {id(c.script): c.script for c in missing}.values():
                await self.redis.script_load(script.script)
            for call in missing:
                call.resent = True
            self._queued[:0] = missing


def _fail(batch: list[_Call], exc: BaseException) -> None:
    error = (
        exc if isinstance(exc, Exception) else RedisConnectionError("the Redis client is closing")
    )
    for call in batch:
        call.settle(exc=error)
