"""A process's view of the fleet: healthy workers, their measured batch time
and throughput, and the queue depth of each tier, refreshed in the background
several times a second (never a Redis round trip per request). Gateways use
it for readiness and admission, dispatchers for pacing."""

import asyncio
from typing import Any

import redis.exceptions

from dispatcher.broker import Broker, FleetSnapshot
from infergate import clock, logs

log = logs.get(__name__)


class FleetView:
    def __init__(self, broker: Broker, refresh_ms: int = 200) -> None:
        self.broker = broker
        self.refresh_s = refresh_ms / 1000.0
        self.snapshot: FleetSnapshot | None = None
        self.redis_ok = False
        self.refreshed = asyncio.Event()
        self._task: asyncio.Task[Any] | None = None

    @property
    def workers_alive(self) -> int:
        return 0 if self.snapshot is None else len(self.snapshot.workers)

    def mark_unreachable(self) -> None:
        """A request just failed to reach Redis: say not ready until a refresh succeeds."""
        self.redis_ok = False

    def batch_ms(self) -> float:
        """Mean measured batch time of the healthy workers (0 if unknown)."""
        times = (
            [w.batch_ms for w in self.snapshot.workers if w.batch_ms > 0] if self.snapshot else []
        )
        return sum(times) / len(times) if times else 0.0

    async def refresh(self) -> None:
        try:
            self.snapshot = await self.broker.fleet_snapshot(clock.now_ms())
            if not self.redis_ok:
                log.info("fleet.redis_ok", workers=self.workers_alive)
            self.redis_ok = True
        except (redis.exceptions.RedisError, OSError) as exc:
            if self.redis_ok:
                log.warning("fleet.redis_unavailable", error=type(exc).__name__)
            self.redis_ok = False
            self.snapshot = None
        self.refreshed.set()

    async def start(self) -> None:
        """Refresh once (so the first request sees the fleet), then keep refreshing."""
        await self.refresh()
        self._task = asyncio.create_task(self._run(), name="fleet-view")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            await self.refresh()
