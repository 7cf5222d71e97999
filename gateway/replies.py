"""Parked requests and the one reply listener per gateway process.

A request parks on an ``asyncio.Future`` keyed by its id; the listener
resolves futures as replies arrive on ``reply:{gateway}`` (one listener per
Redis shard: a worker publishes on the shard it took the batch from). A reply can
arrive twice (a batch retried after a crash between publish and ack): the
first resolves the future and the rest find nothing to resolve. A request
given up on while it may be running (its deadline passed, its client
left) may leave what to do with its reply (``on_late``: settle what it
reserved), once, if the reply comes within a while.

A Redis that restarted empty lost the queues its parked requests waited in:
its token (``GatewayQueue.epoch``) is new when the listener subscribes again.
Its requests still parked then are given the time a running batch needs to
answer (``grace_s``), and those not answered by then get ``QueueLost`` (a
503, to be retried), not a 504 at their deadline.
"""

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec
from infergate.base import clock, logs, wire
from infergate.base.loops import Background, Backoff, Supervised
from infergate.base.queue.gateway import GatewayQueue

log = logs.get(__name__)

# Requests given up on whose late reply is awaited at once, at most.
MOST_LATE = 10_000


class QueueLost(Exception):
    """The Redis that held the request's queue restarted without its contents."""


class ReplyRouter:
    def __init__(
        self,
        queues: list[GatewayQueue],
        on_ignored: Callable[[], None] = lambda: None,
        grace_s: Callable[[], float] = lambda: 1.0,
        on_lost: Callable[[int], None] = lambda shard: None,
    ) -> None:
        self.on_ignored = on_ignored
        self.on_lost = on_lost  # (a shard's subscription broke: its Redis may be gone)
        self.grace_s = grace_s
        self.pending: dict[str, asyncio.Future[wire.Result]] = {}
        self.shard_of: dict[str, int] = {}  # (a request parked on a shard other than 0)
        # Long polls of jobs: woken when the jobs-done channel names their job.
        self.job_waiters: dict[str, list[asyncio.Event]] = {}
        # Requests given up on that may still be answered: until when
        # (monotonic s), and what to do with the reply (``on_late``).
        self.late: dict[str, tuple[float, Callable[[wire.Result], Coroutine[Any, Any, None]]]] = {}
        self._late_answers = Background("replies.late_reply_failed")
        self.duplicates = 0
        self.unreadable = 0
        self.listeners = [_Listener(self, queue, i) for i, queue in enumerate(queues)]

    def park(self, request_id: str, shard: int = 0) -> asyncio.Future[wire.Result]:
        fut: asyncio.Future[wire.Result] = asyncio.get_running_loop().create_future()
        self.pending[request_id] = fut
        if shard:
            self.shard_of[request_id] = shard
        return fut

    def forget(self, request_id: str) -> None:
        self.pending.pop(request_id, None)
        self.shard_of.pop(request_id, None)

    def queue_lost(self, shard: int) -> None:
        """``shard``'s Redis restarted empty: its parked requests get
        ``QueueLost`` once a running batch has had time to answer them."""
        lost = [rid for rid in self.pending if self.shard_of.get(rid, 0) == shard]
        log.warning("replies.queue_lost", shard=shard, parked=len(lost))
        if lost:
            asyncio.get_running_loop().call_later(self.grace_s(), self._fail, lost)

    def _fail(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            fut = self.pending.get(request_id)
            if fut is not None and not fut.done():
                fut.set_exception(QueueLost())

    def on_late(
        self,
        request_id: str,
        until_s: float,
        then: Callable[[wire.Result], Coroutine[Any, Any, None]],
    ) -> None:
        """A request given up on: if its reply comes before ``until_s``
        (monotonic), run ``then`` with it, once."""
        if len(self.late) >= MOST_LATE:
            now = clock.monotonic_s()
            self.late = {rid: late for rid, late in self.late.items() if late[0] > now}
        if len(self.late) < MOST_LATE:
            self.late[request_id] = (until_s, then)

    def deliver(self, reply: wire.Reply) -> None:
        for result in reply.results:
            fut = self.pending.pop(result.id, None)
            if fut is None:
                if not self._answered_late(result):
                    self.duplicates += 1
                    self.on_ignored()
            elif not fut.done():
                fut.set_result(result)

    def _answered_late(self, result: wire.Result) -> bool:
        late = self.late.pop(result.id, None)
        if late is None or late[0] < clock.monotonic_s():
            return False
        self._late_answers.run(late[1](result))
        return True

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
        self.epoch: bytes | None = None  # (its Redis's token, when first subscribed)
        self.subscribed = asyncio.Event()
        self.loop = Supervised("reply-listener", self.listen, 0, Backoff(0.05, 1.0))

    async def listen(self) -> None:
        """Subscribe, then deliver replies until the subscription fails (the
        supervisor logs it and subscribes again after a backoff)."""
        router = self.router
        try:
            async with self.queue.replies() as subscription:
                epoch = await self.queue.epoch()
                if self.epoch is not None and epoch != self.epoch:
                    router.queue_lost(self.shard)
                self.epoch = epoch
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
            if self.subscribed.is_set():
                self.subscribed.clear()
                router.on_lost(self.shard)
