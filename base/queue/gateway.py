"""What a gateway may do in Redis: queue a request, cancel one, charge
quotas (through ``limits``, on this client's connections), read the fleet,
and listen for its own replies."""

import contextlib
from collections.abc import AsyncIterator

from infergate.base.errors import STORE_ERRORS
from infergate.base.queue import dead_letters
from infergate.base.queue.store import Store
from limits.aio.storage import RedisStorage
from redis.asyncio.client import PubSub


class ReplySubscription:
    """This gateway's reply channel, subscribed."""

    def __init__(self, pubsub: PubSub) -> None:
        self._pubsub = pubsub

    async def next_message(self, timeout_s: float) -> bytes | None:
        """The next reply's raw bytes, or None if none came within ``timeout_s``."""
        message = await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=timeout_s)
        if message is None or message.get("type") != "message":
            return None
        data: bytes = message["data"]
        return data


class GatewayQueue:
    def __init__(self, store: Store, gateway_id: str) -> None:
        self.store = store
        self.keys = store.keys
        self.gateway_id = gateway_id

    async def enqueue(self, tier: str, envelope: bytes) -> int:
        """Queue an envelope and wake a dispatcher; returns the tier's queue depth."""
        depth = await self.store.scripts.enqueue(
            keys=[self.keys.queue(tier), self.keys.doorbell], args=[envelope]
        )
        return int(depth)

    async def cancel(self, request_id: str, until_ms: int) -> None:
        """Mark a queued request as abandoned; ``take`` drops it."""
        await self.store.redis.zadd(self.keys.cancelled, {request_id: until_ms})

    async def dead_letters(self, limit: int) -> tuple[int, list[dead_letters.DeadLetter]]:
        """For operators: the dead-letter list's size and its newest ``limit`` batches."""
        return await dead_letters.read(self.store, limit)

    async def purge_dead_letters(self) -> int:
        return await dead_letters.purge(self.store)

    def quota_storage(self) -> RedisStorage:
        """``limits``' storage on this process's connection pool, under the namespace."""
        return RedisStorage(
            "async+redis://",
            implementation="redispy",
            key_prefix=self.keys.ratelimit_prefix,
            connection_pool=self.store.redis.connection_pool,  # type: ignore[arg-type]
        )

    @contextlib.asynccontextmanager
    async def replies(self) -> AsyncIterator[ReplySubscription]:
        """Subscribe to this gateway's reply channel for the life of the block."""
        pubsub = self.store.redis.pubsub()
        try:
            await pubsub.subscribe(self.keys.reply_channel(self.gateway_id))
            yield ReplySubscription(pubsub)
        finally:
            with contextlib.suppress(*STORE_ERRORS):
                await pubsub.aclose()  # type: ignore[no-untyped-call]
