"""A gateway's give-backs of token reservations (``settle.lua``), gathered:
the first goes at once, and those made while a call is in flight go
together in the next, so a batch's answers (which arrive together) cost
Redis and the gateway one call rather than one each. Each caller waits
for its own call: a request is answered once what it gave back is in."""

import asyncio
from collections.abc import Sequence
from typing import Any

from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError

MOST = 256  # give-backs in one call


class Settlements:
    """One Redis's give-backs from one process, gathered into calls."""

    def __init__(self, script: AsyncScript) -> None:
        self.script = script
        self._waiting: list[tuple[list[str], list[int], asyncio.Future[None]]] = []
        self._sender: asyncio.Task[None] | None = None

    def give_back(self, names: list[str], args: list[int]) -> "asyncio.Future[None]":
        """Windows ``names`` and, for each, its bucket, what goes back and
        what was reserved (``settle.lua``'s arguments); the future is done
        once they are in."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((names, args, future))
        if self._sender is None:
            self._sender = asyncio.ensure_future(self._send_all())
        return future

    async def _send_all(self) -> None:
        try:
            while self._waiting:
                gathered, self._waiting = self._waiting[:MOST], self._waiting[MOST:]
                await self._send(gathered)
        finally:
            self._sender = None
            _fail(self._waiting, RedisConnectionError("the give-backs' sender stopped"))
            self._waiting = []

    async def _send(self, gathered: Sequence[tuple[list[str], list[int], Any]]) -> None:
        names = [name for one in gathered for name in one[0]]
        args = [arg for one in gathered for arg in one[1]]
        try:
            await self.script(names, args)
        except Exception as exc:  # (each caller's to handle: Redis away, mostly)
            _fail(gathered, exc)
        else:
            for _, _, future in gathered:
                if not future.done():
                    future.set_result(None)


def _fail(waiting: Sequence[tuple[Any, Any, "asyncio.Future[None]"]], exc: Exception) -> None:
    for _, _, future in waiting:
        if not future.done():
            future.set_exception(exc)
