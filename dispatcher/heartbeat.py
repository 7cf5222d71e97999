"""Heartbeats: every process keeps a key with a TTL; the reaper treats an
owner whose key has expired as dead."""

import asyncio
from collections.abc import Callable
from typing import Any

import redis.exceptions

from dispatcher import wire
from dispatcher.broker import Broker
from infergate import logs

log = logs.get(__name__)


class Heartbeater:
    """Beats every ``interval_ms`` with whatever ``status()`` returns.

    A failed beat (Redis away) is logged and retried at the next interval; the
    process keeps running and its key simply expires if Redis stays away.
    """

    def __init__(
        self,
        broker: Broker,
        status: Callable[[], wire.Heartbeat],
        interval_ms: int,
        ttl_ms: int,
    ) -> None:
        self.broker = broker
        self.status = status
        self.interval_s = interval_ms / 1000.0
        self.ttl_ms = ttl_ms
        self.healthy = False
        self._task: asyncio.Task[Any] | None = None

    async def beat_once(self) -> None:
        await self.broker.beat(self.status(), self.ttl_ms)
        self.healthy = True

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="heartbeat")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            try:
                await self.beat_once()
            except (redis.exceptions.RedisError, OSError) as exc:
                if self.healthy:
                    log.warning("heartbeat.failed", error=type(exc).__name__)
                self.healthy = False
            await asyncio.sleep(self.interval_s)
