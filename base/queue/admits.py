"""A gateway's admits, gathered: every request that arrives within one
moment is charged and queued by one call of ``admit.lua``.

On a Redis that is not busy, what a lone command costs Redis is mostly
being woken for it (the system calls around it), several times what the
command itself costs; an admit per request is a wake per request. So a
gateway sends its admits at most once every ``every_s``: the first request
after a quiet spell goes at once, and those that arrive within ``every_s``
of a call go together in the next, each run in turn as if it came alone
(one request's failure fails only that request). A call holds at most
``MOST`` admits and about ``MOST_BYTES`` of arguments, so that no one call
holds Redis (and the workers' answers behind it) for long; a backlog of
more goes in calls back to back. The latency this adds is at most
``every_s`` plus the call in flight, and only under load.
"""

import asyncio
import contextlib
from typing import Any

from infergate.base.errors import STORE_ERRORS, out_of_memory
from infergate.base.queue.pipelined import Pipelined
from infergate.base.queue.resp import error_of
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

EVERY_S = 0.005  # at most one call of admits a gateway per Redis every this long
MOST = 128  # admits in one call
MOST_BYTES = 256 * 1024  # arguments in one call (one admit's, whatever its size)


class _Admit:
    __slots__ = ("args", "before", "future", "keys", "size")

    def __init__(
        self,
        keys: list[str],
        args: list[Any],
        before: tuple[Any, ...] | None,
        future: "asyncio.Future[Any]",
    ) -> None:
        self.keys = keys
        self.args = args
        self.before = before  # ('SET', key, ...) or None
        self.future = future
        written = (*args, *(before or ()))
        self.size = sum(len(a) for a in written if isinstance(a, (bytes, str)))


class Admits:
    """One Redis's admits from one process, gathered into calls."""

    def __init__(self, pipelined: Pipelined, script: AsyncScript, every_s: float = EVERY_S) -> None:
        self.pipelined = pipelined
        self.script = script
        self.every_s = every_s
        self._waiting: list[_Admit] = []
        self._sender: asyncio.Task[None] | None = None
        self._last_sent = -float("inf")
        self._closed = False

    def admit(
        self, keys: list[str], args: list[Any], before: tuple[Any, ...] | None = None
    ) -> "asyncio.Future[Any]":
        """One request's admit (its keys and arguments, as ``admit.lua``
        reads a request's); the future gets its reply. ``before``: a SET
        sent just before the call that holds it (a long input's: inputs.py),
        its key deleted (once the call's callers are answered) if the call
        is refused out of memory (the SET may have been taken: it is what
        filled Redis) or the request fails, its caller gone or not."""
        future = asyncio.get_running_loop().create_future()
        if self._closed:
            future.set_exception(RedisConnectionError("the Redis client is closing"))
            return future
        self._waiting.append(_Admit(keys, args, before, future))
        if self._sender is None:
            self._sender = asyncio.ensure_future(self._send_all())
        return future

    async def close(self) -> None:
        """Stop sending: what waits fails (also when the sender was cancelled
        before it first ran, and so never reached its own clean-up); what
        comes later fails at once."""
        self._closed = True
        if self._sender is not None:
            self._sender.cancel()
            await asyncio.gather(self._sender, return_exceptions=True)
            self._sender = None
        _fail(self._waiting, RedisConnectionError("the Redis client is closing"))
        self._waiting = []

    async def _send_all(self) -> None:
        """Send what waits, a call at a time, no two within ``every_s``
        unless a whole call's worth waits."""
        loop = asyncio.get_running_loop()
        try:
            while self._waiting:
                wait_s = self._last_sent + self.every_s - loop.time()
                if wait_s > 0 and not self._a_call_waits():
                    await asyncio.sleep(wait_s)
                gathered = self._next_call()
                if not gathered:  # (their callers all gave up: nothing sent)
                    continue
                self._last_sent = loop.time()
                await self._send(gathered)
        finally:
            self._sender = None
            if self._waiting:  # cancelled (the process stops): nothing is left waiting
                _fail(self._waiting, RedisConnectionError("the Redis client is closing"))
                self._waiting = []

    def _a_call_waits(self) -> bool:
        """A whole call's worth waits (it goes without waiting its turn)."""
        size = 0
        for count, one in enumerate(self._waiting, 1):
            size += one.size
            if count >= MOST or size >= MOST_BYTES:
                return True
        return False

    def _next_call(self) -> list[_Admit]:
        """The admits of the next call, oldest first: at most ``MOST`` and
        ``MOST_BYTES`` (one, however big). Those whose callers gave up
        (cancelled) are not sent: nothing of theirs reaches Redis."""
        gathered: list[_Admit] = []
        size, passed = 0, 0
        for one in self._waiting:
            if len(gathered) == MOST or (gathered and size + one.size > MOST_BYTES):
                break
            passed += 1
            if not one.future.done():
                gathered.append(one)
                size += one.size
        del self._waiting[:passed]
        return gathered

    async def _send(self, gathered: list[_Admit]) -> None:
        keys: list[str] = []
        args: list[Any] = [len(gathered)]
        for one in gathered:
            args += (len(one.keys), len(one.args))
        for one in gathered:
            keys += one.keys
            args += one.args
        before = [one.before for one in gathered if one.before is not None]
        try:
            replies = await self.pipelined.call(self.script, keys, args, before)
        except asyncio.CancelledError:
            _fail(gathered, RedisConnectionError("the Redis client is closing"))
            raise
        except BaseException as exc:
            _fail(gathered, exc)
            if out_of_memory(exc):  # refused whole: nothing of it was queued
                await self._drop_inputs(gathered)
            return
        if not isinstance(replies, list) or len(replies) != len(gathered):
            _fail(
                gathered,
                ResponseError(f"admit.lua answered {len(gathered)} admits with {replies!r:.80}"),
            )
            return
        _settle(gathered, replies)
        # (a request's own error: it was not queued)
        await self._drop_inputs(
            [o for o, r in zip(gathered, replies, strict=True) if isinstance(r, bytes)]
        )

    async def _drop_inputs(self, refused: list[_Admit]) -> None:
        """Delete the inputs written before the admits of requests that
        were not queued (a refusal by the script deletes its own): they
        would wait out their TTL. One DEL, which Redis allows when full."""
        keys = [one.before[1] for one in refused if one.before is not None]
        if keys:
            with contextlib.suppress(*STORE_ERRORS):
                await self.pipelined.redis.delete(*keys)


def _settle(gathered: list[_Admit], replies: list[Any]) -> None:
    for one, reply in zip(gathered, replies, strict=True):
        if one.future.done():  # its caller gave up (cancelled)
            continue
        if isinstance(reply, bytes):  # that request's own error
            one.future.set_exception(error_of(ResponseError(reply.decode(errors="replace"))))
        else:
            one.future.set_result(reply)


def _fail(gathered: list[_Admit], exc: BaseException) -> None:
    for one in gathered:
        if not one.future.done():
            with contextlib.suppress(asyncio.InvalidStateError):
                one.future.set_exception(exc)
