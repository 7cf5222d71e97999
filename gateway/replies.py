"""Parked requests and the one pub/sub listener per gateway process.

A request parks on an ``asyncio.Future`` keyed by its id; the listener
resolves futures as replies arrive on ``reply:{gateway}``. A reply can
arrive twice (a batch retried after a crash between publish and ack): the
first resolves the future and the rest find nothing to resolve.
"""

import asyncio
import contextlib
from typing import Any

import msgspec
import redis.exceptions
from redis.asyncio import Redis

from dispatcher import wire
from infergate import logs

log = logs.get(__name__)


class ReplyRouter:
    def __init__(self, redis: Redis, channel: str) -> None:
        self.redis = redis
        self.channel = channel
        self.pending: dict[str, asyncio.Future[wire.Result]] = {}
        self.subscribed = asyncio.Event()
        self.duplicates = 0
        self._task: asyncio.Task[Any] | None = None

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
            elif not fut.done():
                fut.set_result(result)

    async def start(self, timeout_s: float = 5.0) -> None:
        self._task = asyncio.create_task(self._run(), name="reply-listener")
        await asyncio.wait_for(self.subscribed.wait(), timeout_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        backoff_s = 0.05
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.channel)
                self.subscribed.set()
                backoff_s = 0.05
                log.info("replies.subscribed", channel=self.channel)
                while True:
                    message = await pubsub.get_message(timeout=1.0)
                    if message is None or message.get("type") != "message":
                        continue
                    try:
                        self.deliver(wire.decode_reply(message["data"]))
                    except msgspec.DecodeError:
                        log.error("replies.unreadable", size=len(message["data"]))
            except (redis.exceptions.RedisError, OSError) as exc:
                self.subscribed.clear()
                log.warning("replies.disconnected", error=type(exc).__name__, retry_s=backoff_s)
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, 1.0)
            finally:
                with contextlib.suppress(redis.exceptions.RedisError, OSError):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]
