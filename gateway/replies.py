"""Parked requests and the one reply listener per gateway process.

A request parks on an ``asyncio.Future`` keyed by its id; the listener
resolves futures as replies arrive on ``reply:{gateway}`` (one listener per
Redis shard: a worker publishes on the shard it took the batch from). A reply can
arrive twice (a batch retried after a crash between publish and ack): the
first resolves the future and the rest find nothing to resolve.
"""

import asyncio
import contextlib
from collections.abc import Callable

import msgspec
from infergate.base import logs, wire
from infergate.base.loops import Backoff, Supervised
from infergate.base.queue.gateway import GatewayQueue

log = logs.get(__name__)


class ReplyRouter:
    def __init__(
        self, queues: list[GatewayQueue], on_ignored: Callable[[], None] = lambda: None
    ) -> None:
        self.on_ignored = on_ignored
        self.pending: dict[str, asyncio.Future[wire.Result]] = {}
        # Long polls of jobs: woken when the jobs-done channel names their job.
        self.job_waiters: dict[str, list[asyncio.Event]] = {}
        self.duplicates = 0
        self.unreadable = 0
        self.listeners = [_Listener(self, queue, i) for i, queue in enumerate(queues)]

    def park(self, request_id: str) -> asyncio.Future[wire.Result]:
        fut: asyncio.Future[wire.Result] = asyncio.get_running_loop().create_future()
        self.pending[request_id] = fut
        return fut

    def forget(self, request_id: str) -> None:
        self.pending.pop(request_id, None)

    def deliver(self, reply: wire.Reply) -> None:
        for result in reply.results:
            fut = self.pending.pop(result.id, None)
            if fut is None:
                self.duplicates += 1
                self.on_ignored()
            elif not fut.done():
                fut.set_result(result)

    async def wait_job(self, job_id: str, timeout_s: float) -> None:
        """Until the jobs-done channel names ``job_id``, or ``timeout_s`` passes."""
        event = asyncio.Event()
        self.job_waiters.setdefault(job_id, []).append(event)
        try:
            async with asyncio.timeout(timeout_s):
                await event.wait()
        except TimeoutError:
            pass
        finally:
            waiters = self.job_waiters.get(job_id)
            if waiters is not None and event in waiters:
                waiters.remove(event)
                if not waiters:
                    del self.job_waiters[job_id]

    def listening(self, shard: int = 0) -> bool:
        listener = self.listeners[shard]
        return listener.subscribed.is_set() and listener.loop.running

    async def start(self, timeout_s: float = 5.0) -> None:
        """Start listening; wait a little for the subscriptions, but start
        anyway while a Redis is away (``/readyz`` says not ready until one is up)."""
        for listener in self.listeners:
            listener.loop.start()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                asyncio.gather(*(listener.subscribed.wait() for listener in self.listeners)),
                timeout_s,
            )

    async def stop(self) -> None:
        for listener in self.listeners:
            await listener.loop.stop()
            listener.subscribed.clear()

    def jobs_done(self, job_ids: list[str]) -> None:
        for job_id in job_ids:
            for event in self.job_waiters.pop(job_id, ()):
                event.set()

    def deliver_raw(self, data: bytes) -> None:
        try:
            reply = wire.decode_reply(data)
        except msgspec.DecodeError:
            self.unreadable += 1
            log.error("replies.unreadable", size=len(data))
            return
        self.deliver(reply)


class _Listener:
    """The subscription to one shard's reply channel."""

    def __init__(self, router: ReplyRouter, queue: GatewayQueue, shard: int) -> None:
        self.router = router
        self.queue = queue
        self.shard = shard
        self.subscribed = asyncio.Event()
        self.loop = Supervised("reply-listener", self.listen, 0, Backoff(0.05, 1.0))

    async def listen(self) -> None:
        """Subscribe, then deliver replies until the subscription fails (the
        supervisor logs it and subscribes again after a backoff)."""
        router = self.router
        try:
            async with self.queue.replies() as subscription:
                self.subscribed.set()
                self.loop.backoff.reset()
                log.info("replies.subscribed", shard=self.shard)
                while True:
                    data, jobs_done = await subscription.next_message(timeout_s=1.0)
                    if data is not None:
                        router.deliver_raw(data)
                    if jobs_done:
                        router.jobs_done(jobs_done)
        finally:
            self.subscribed.clear()
