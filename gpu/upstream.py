"""A worker's eye on the server its backend calls (a remote backend's).

The fleet's health follows the server's: a call it could not answer makes
the backend unhealthy at once, and the heartbeat says so (admission counts
the worker out: prompt 503s, not 504s at the deadline). While idle the
worker asks the server every ``PROBE_INTERVAL_S`` whether it answers, so a
server that went down between batches is seen before a batch is given to
it. While the server is down the worker takes nothing: its credit is off
``ready``, a batch handed to it goes to the shared list for another worker
(``step_aside``), and it asks again every second; once it answers, the
credit is offered again and the worker takes work as before.
"""

import asyncio
import contextlib

from infergate.base import clock, logs
from infergate.base.queue.worker import WorkerQueue
from infergate.gpu.backend import Upstream

log = logs.get(__name__)

PROBE_INTERVAL_S = 2.0
DOWN_PROBE_INTERVAL_S = 1.0


class UpstreamWatch:
    def __init__(self, upstream: Upstream | None, queue: WorkerQueue) -> None:
        self.upstream = upstream
        self.queue = queue
        self._probed_at = clock.monotonic_s()

    @property
    def down(self) -> bool:
        return self.upstream is not None and not self.upstream.healthy

    async def probe(self) -> bool:
        """Ask the server now (off the event loop); whether it answers."""
        assert self.upstream is not None
        self._probed_at = clock.monotonic_s()
        return await asyncio.to_thread(self.upstream.probe)

    async def ready_to_take(self, stop: asyncio.Event) -> bool:
        """Idle, before looking for work: the server asked when due; while
        it is down, the worker steps aside and waits for it. False if
        ``stop`` came first."""
        if self.upstream is None:
            return True
        if not self.down and clock.monotonic_s() - self._probed_at < PROBE_INTERVAL_S:
            return True
        if not self.down and await self.probe():
            return True
        log.warning("worker.upstream_down", worker_id=self.queue.worker_id)
        while not stop.is_set():
            await self.queue.step_aside()  # (again each time: a credit a dispatcher held came back)
            if await self.probe():
                log.info("worker.upstream_up", worker_id=self.queue.worker_id)
                await self.queue.ensure_credit()
                return True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), DOWN_PROBE_INTERVAL_S)
        return False

    async def wait_until_up(self, stop: asyncio.Event, what: str) -> bool:
        """Before the worker joins the fleet: wait for the server (logged
        every 10 s). False if ``stop`` came first."""
        if self.upstream is None:
            return True
        said_at = 0.0
        while not stop.is_set():
            if await self.probe():
                return True
            if clock.monotonic_s() - said_at >= 10.0:
                said_at = clock.monotonic_s()
                log.warning("worker.upstream_waiting", worker_id=self.queue.worker_id, before=what)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), DOWN_PROBE_INTERVAL_S)
        return False
