"""Script calls of many concurrent requests, written to Redis together.

redis-py spends more CPU on one command's way through its client (a
connection taken from the pool and given back under a lock, a timeout
context per reply, retries, observability hooks) than Redis spends running
it. On the gateway's hot path every request makes one call (``admit.lua``),
so the calls are queued here and sent by one flushing task, packed by
hiredis (in C): whatever is queued goes out as one write, its replies are
read in order, and what arrives during that round trip goes out in the
next. Under load the batches grow by themselves; alone, a call goes out at
once, written by its caller (the flushing task then reads its reply). A
worker's answer (its replies, the ack, and for a small batch the take
before them) goes the same way, as one MULTI/EXEC (``transaction``): at
low load it is on every request's way back.

The calls go over one connection of the client's pool that this class
holds, read straight from its stream (``resp.RawConnection``). A round
trip that takes longer than the client's socket timeout ends the
connection, as redis-py would: a hung Redis fails the calls instead of
holding them.

Nothing is re-sent after an error, as everywhere (``store.connect``): a
call whose reply was lost fails with the connection's error, and the next
flush opens a new connection. The one exception is NOSCRIPT (a restarted or
failed-over Redis has no scripts): Redis refused those calls without running
them, so they are sent once more after the script is loaded (with the
commands sent before them, which ran: a long input's SET, written again).
"""

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

from hiredis import pack_command
from infergate.base.errors import STORE_ERRORS, UNAVAILABLE
from infergate.base.queue.resp import RawConnection, error_of, hold, let_go
from infergate.base.queue.scripts import evalsha
from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError


class _Call:
    """One script call: its command, after any it needs run first (their
    replies are not read: the script checks what it depends on, as
    ``admit.lua`` refuses a request whose input's SET Redis refused)."""

    __slots__ = ("commands", "future", "resent", "scripts")

    def __init__(
        self,
        scripts: Sequence[AsyncScript],
        commands: tuple[tuple[Any, ...], ...],
        future: "asyncio.Future[Any]",
    ) -> None:
        self.scripts = scripts  # loaded again if Redis answers NOSCRIPT
        self.commands = commands
        self.future = future
        self.resent = False

    @property
    def expects(self) -> int:
        """How many replies it reads."""
        return len(self.commands)

    def outcome(self, replies: list[Any]) -> Any:
        """Its result (or the error it is settled with) from its replies."""
        return replies[-1]

    def settle(self, reply: Any = None, exc: BaseException | None = None) -> None:
        if self.future.done():  # its caller gave up (cancelled)
            return
        if exc is not None:
            self.future.set_exception(exc)
        else:
            self.future.set_result(reply)


class _Transaction(_Call):
    """Commands run as one MULTI/EXEC: the replies of all of them, or the
    first error among them (NOSCRIPT first: the whole transaction is sent
    again once its scripts are loaded, so it must be one that may run twice)."""

    __slots__ = ()

    def outcome(self, replies: list[Any]) -> Any:
        queued, executed = replies[1:-1], replies[-1]
        errors = [r for r in queued if isinstance(r, Exception)]  # refused when queued
        if not errors and isinstance(executed, Exception):
            errors = [executed]
        if not errors and executed is None:  # (no WATCH here: not expected)
            errors = [RedisConnectionError("the transaction was aborted")]
        if not errors:
            executed = [error_of(r) if isinstance(r, ResponseError) else r for r in executed]
            errors = [r for r in executed if isinstance(r, Exception)]
        if not errors:
            return executed
        missing = [e for e in errors if isinstance(e, NoScriptError)]
        return (missing or errors)[0]


class _Commands(_Call):
    """Plain commands sent together (not a transaction): their replies, an
    error reply as its exception in its place, as redis-py's pipeline gives
    them with ``raise_on_error=False``; but a primary that is no longer one
    fails the whole call (the connection is then dropped, as for any call)."""

    __slots__ = ()

    def outcome(self, replies: list[Any]) -> Any:
        moved = [r for r in replies if isinstance(r, UNAVAILABLE)]
        return moved[0] if moved else replies


class Pipelined:
    """Queued script calls on one client, flushed a batch per round trip."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self._queued: list[_Call] = []
        self._flusher: asyncio.Task[None] | None = None
        self._written: list[_Call] = []  # on the wire before the flusher first ran
        self._link: RawConnection | None = None

    def call(
        self,
        script: AsyncScript,
        keys: list[str],
        args: list[Any],
        before: Sequence[tuple[Any, ...]] = (),
    ) -> "asyncio.Future[Any]":
        """EVALSHA ``script`` with ``keys`` and ``args``, right after the
        commands ``before`` (in the same write); the future gets its reply."""
        commands = (*before, evalsha(script, keys, args))
        return self._queue(_Call((script,), commands, self._future()))

    def transaction(
        self, commands: Sequence[tuple[Any, ...]], scripts: Sequence[AsyncScript]
    ) -> "asyncio.Future[list[Any]]":
        """``commands`` in one MULTI/EXEC; the future gets their replies (or,
        after all ran, the first error among them, NOSCRIPT before any
        other). ``scripts``: those its EVALSHAs run. Sent again whole if
        Redis had forgotten a script (those commands failed, the others
        ran): only for commands that may run twice."""
        framed = (("MULTI",), *commands, ("EXEC",))
        return self._queue(_Transaction(scripts, framed, self._future()))

    def commands(self, commands: Sequence[tuple[Any, ...]]) -> "asyncio.Future[list[Any]]":
        """``commands`` (no script among them) in the next write; the future
        gets their replies, an error reply as its exception in its place."""
        return self._queue(_Commands((), tuple(commands), self._future()))

    @staticmethod
    def _future() -> "asyncio.Future[Any]":
        return asyncio.get_running_loop().create_future()

    def _queue(self, call: _Call) -> "asyncio.Future[Any]":
        self._queued.append(call)
        if self._flusher is None:
            # Nothing in flight: on an open connection the call is written
            # now, not one turn of the event loop later, when the flushing
            # task first runs (it reads the replies).
            link, written = self._link, None
            if link is not None and link.usable():
                written, self._queued = self._queued, []
                link.write(_packed(written))
                self._written = written
            self._flusher = asyncio.ensure_future(self._flush(written))
        return call.future

    async def close(self) -> None:
        """Stop flushing (what is queued fails) and give the connection back."""
        if self._flusher is not None:
            self._flusher.cancel()
            await asyncio.gather(self._flusher, return_exceptions=True)
            self._flusher = None
        # (a flusher cancelled before it first ran never reached its clean-up)
        closing = RedisConnectionError("the Redis client is closing")
        _fail([*self._written, *self._queued], closing)
        self._written, self._queued = [], []
        await self._drop_link()

    async def _flush(self, written: list[_Call] | None = None) -> None:
        """Send what is queued, a batch per round trip, until nothing is;
        ``written``: a first batch already on the wire."""
        self._written = []
        try:
            while written is not None or self._queued:
                if written is not None:
                    batch, on_the_wire, written = written, True, None
                else:
                    batch, on_the_wire, self._queued = self._queued, False, []
                try:
                    await self._send(batch, on_the_wire)
                except BaseException as exc:
                    _fail(batch, exc)
                    with contextlib.suppress(Exception):  # a broken link is dropped anyway
                        await self._drop_link()
                    if isinstance(exc, asyncio.CancelledError):
                        raise
        finally:
            self._flusher = None
            if self._queued:  # cancelled (the process stops): nothing is left waiting
                _fail(self._queued, RedisConnectionError("the Redis client is closing"))
                self._queued = []

    async def _send(self, batch: list[_Call], written: bool = False) -> None:
        """One write (unless ``written`` already, on the held link), then the
        replies in order, each call settled as its replies arrive. A
        connection error fails the calls not yet answered (the caller fails
        them; a settled call stays settled)."""
        link = self._link
        if written:
            if link is None:  # (only this task drops it, and it wrote to it)
                raise RedisConnectionError("the Redis connection was dropped")
        else:
            if link is None or not link.usable():
                await self._drop_link()
                link = await self._open_link()
            link.write(_packed(batch))
        missing: list[_Call] = []
        lost: list[Exception] = []
        calls = iter(batch)
        call = next(calls)
        replies: list[Any] = []

        def take(_: int, reply: Any) -> None:
            nonlocal call, replies
            replies.append(reply)
            if len(replies) < call.expects:
                return
            outcome = call.outcome(replies)
            if isinstance(outcome, NoScriptError) and not call.resent:
                missing.append(call)
            elif isinstance(outcome, Exception):  # this call's own error (the script's) ...
                call.settle(exc=outcome)
                if isinstance(outcome, UNAVAILABLE):  # ... or a primary no longer primary
                    lost.append(outcome)
            else:
                call.settle(outcome)
            call, replies = next(calls, call), []

        expected = sum(c.expects for c in batch)
        await link.replies(expected, link.connection.socket_timeout, take)
        if lost:  # a new connection asks Sentinel where the primary is now
            await self._drop_link()
            _fail(missing, lost[0])  # not run on this primary; nothing sent twice
            return
        if missing:
            await _load_scripts(link, [s for c in missing for s in c.scripts])
            for call in missing:
                call.resent = True
            self._queued[:0] = missing

    async def _open_link(self) -> RawConnection:
        self._link = await hold(self.redis)
        return self._link

    async def _drop_link(self) -> None:
        link, self._link = self._link, None
        if link is not None:
            await let_go(self.redis, link)


def _packed(batch: list[_Call]) -> bytes:
    return b"".join([pack_command(c) for call in batch for c in call.commands])


async def _load_scripts(link: RawConnection, scripts: list[AsyncScript]) -> None:
    """SCRIPT LOAD on the connection that just answered NOSCRIPT (it is up;
    one of the pool's might be from before a restart)."""
    distinct = list({s.sha: s for s in scripts}.values())
    loads: list[tuple[Any, ...]] = [("SCRIPT", "LOAD", s.script) for s in distinct]
    link.write(b"".join([pack_command(c) for c in loads]))
    errors: list[Exception] = []
    await link.replies(
        len(distinct),
        link.connection.socket_timeout,
        lambda i, reply: errors.append(reply) if isinstance(reply, Exception) else None,
    )
    if errors:
        raise errors[0]


def _fail(batch: list[_Call], exc: BaseException) -> None:
    """Fail every call not yet settled, with a store error (what callers answer 503 to)."""
    if isinstance(exc, STORE_ERRORS):
        error: Exception = exc  # type: ignore[assignment]
    elif isinstance(exc, Exception):
        error = RedisConnectionError(f"the Redis connection failed: {type(exc).__name__}")
    else:
        error = RedisConnectionError("the Redis client is closing")
    for call in batch:
        call.settle(exc=error)
