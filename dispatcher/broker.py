"""Every Redis operation on the queueing data model, for all three roles.

A request lives in exactly one place at a time: ``queue:{tier}`` ->
``inflight:{dispatcher}`` -> ``batches`` -> ``processing:{worker}`` ->
answered. Each move below is one atomic Redis operation (a Lua script or
BLMOVE); nothing newer than Redis 6.2 is used.
"""

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff

from dispatcher import wire
from dispatcher.keys import TIERS, Keys
from dispatcher.scripts import Scripts


def connect(
    url: str, *, block_s: float = 0.0, name: str | None = None, max_connections: int = 32
) -> Redis:
    """A client for one process. ``block_s`` is the longest blocking pop it
    will issue; the socket timeout leaves room for it, so a dead Redis is
    noticed instead of hanging. Under a burst, commands wait (up to 2 s) for
    one of ``max_connections`` connections instead of failing."""
    pool = BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=2.0,
        socket_connect_timeout=1.0,
        socket_timeout=block_s + 2.0,
        client_name=name,
        # Fail fast when Redis is away: callers answer 503 or back off themselves.
        retry=Retry(ExponentialWithJitterBackoff(base=0.01, cap=0.1), retries=2),
    )
    return Redis.from_pool(pool)  # the client owns (and closes) its pool


class TakeResult(msgspec.Struct, frozen=True):
    envelopes: list[bytes]
    expired: int
    cancelled: int
    malformed: int
    # > 0: pacing says come back after this many ms (nothing was taken).
    wait_ms: int = 0


class FleetSnapshot(msgspec.Struct, frozen=True):
    """What a gateway knows about the fleet, refreshed in the background."""

    workers: list[wire.Heartbeat]
    queue_depth: dict[str, int]
    taken_ms: int


class Broker:
    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self.scripts = Scripts(redis)

    # -- gateway ------------------------------------------------------------

    async def enqueue(self, tier: str, envelope: bytes) -> int:
        """Queue an envelope and wake a dispatcher; returns the tier's queue depth."""
        depth = await self.scripts.enqueue(
            keys=[self.keys.queue(tier), self.keys.doorbell], args=[envelope]
        )
        return int(depth)

    async def cancel(self, request_id: str, until_ms: int) -> None:
        """Mark a queued request as abandoned; ``take`` drops it."""
        await self.redis.zadd(self.keys.cancelled, {request_id: until_ms})

    async def fleet_snapshot(self, now_ms: int) -> FleetSnapshot:
        workers = await self.alive("worker")
        async with self.redis.pipeline(transaction=False) as pipe:
            for q in self.keys.queues:
                pipe.llen(q)
            depths = await pipe.execute()
        return FleetSnapshot(workers, dict(zip(TIERS, map(int, depths), strict=True)), now_ms)

    # -- heartbeats ---------------------------------------------------------

    async def beat(self, hb: wire.Heartbeat, ttl_ms: int) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(self.keys.heartbeat(hb.role, hb.id), wire.encode(hb), px=ttl_ms)
            pipe.sadd(self.keys.members(hb.role), hb.id)
            await pipe.execute()

    async def retire(self, role: str, process_id: str) -> None:
        """A clean exit: drop the heartbeat and the membership at once."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.delete(self.keys.heartbeat(role, process_id))
            pipe.srem(self.keys.members(role), process_id)
            await pipe.execute()

    async def members(self, role: str) -> list[str]:
        raw: set[bytes] = await self.redis.smembers(self.keys.members(role))  # type: ignore[assignment]
        return sorted(m.decode() for m in raw)

    async def alive(self, role: str) -> list[wire.Heartbeat]:
        ids = await self.members(role)
        if not ids:
            return []
        values: list[bytes | None] = await self.redis.mget(
            [self.keys.heartbeat(role, i) for i in ids]
        )  # type: ignore[assignment]
        return [wire.decode_heartbeat(v) for v in values if v is not None]

    # -- dispatcher ---------------------------------------------------------

    async def wait_credit(self, dispatcher_id: str, timeout_s: float) -> str | None:
        """Block until an idle worker's credit is free, and hold it in
        ``credits:{dispatcher}`` (returned to ``ready`` if this dispatcher dies)."""
        credit: bytes | None = await self.redis.blmove(  # type: ignore[assignment]
            self.keys.ready,
            self.keys.credits(dispatcher_id),
            timeout_s,  # type: ignore[arg-type]  # BLMOVE takes fractional seconds
            "RIGHT",
            "LEFT",
        )
        return None if credit is None else credit.decode()

    async def take(
        self,
        dispatcher_id: str,
        n: int,
        now_ms: int,
        min_slots: Sequence[int],
        min_interval_ms: int = 0,
    ) -> TakeResult:
        raw: Any = await self.scripts.take(
            keys=[
                self.keys.inflight(dispatcher_id),
                self.keys.stats,
                self.keys.doorbell,
                self.keys.cancelled,
                self.keys.last_dispatch,
                *self.keys.queues,
            ],
            args=[n, now_ms, min_interval_ms, *min_slots],
        )
        envelopes, expired, cancelled, malformed, wait_ms = raw
        return TakeResult(
            list(envelopes), int(expired), int(cancelled), int(malformed), int(wait_ms)
        )

    async def wait_doorbell(self, timeout_s: float) -> bool:
        return await self.redis.blpop([self.keys.doorbell], timeout_s) is not None

    async def handoff(
        self, dispatcher_id: str, credit: str, batch: bytes, size: int, now_ms: int
    ) -> None:
        await self.scripts.handoff(
            keys=[
                self.keys.inflight(dispatcher_id),
                self.keys.batches,
                self.keys.credits(dispatcher_id),
                self.keys.stats,
                self.keys.last_dispatch,
            ],
            args=[batch, credit, size, now_ms],
        )

    async def requeue(self, dispatcher_id: str) -> tuple[int, int]:
        """Return a dispatcher's inflight envelopes and held credits."""
        envs, credits = await self.scripts.requeue(
            keys=[
                self.keys.inflight(dispatcher_id),
                self.keys.credits(dispatcher_id),
                self.keys.ready,
                self.keys.doorbell,
                self.keys.stats,
                *self.keys.queues,
            ],
            args=list(TIERS),
        )
        return int(envs), int(credits)

    # -- worker -------------------------------------------------------------

    async def offer_credit(self, worker_id: str) -> None:
        """A worker with nothing in hand says it is idle (idempotent)."""
        await self.scripts.finish(
            keys=[self.keys.processing(worker_id), self.keys.ready], args=[worker_id, "1"]
        )

    async def finish_idle(self, worker_id: str) -> None:
        """A worker leaving cleanly withdraws its credit."""
        await self.scripts.finish(
            keys=[self.keys.processing(worker_id), self.keys.ready], args=[worker_id, "0"]
        )

    async def ensure_credit(self, worker_id: str) -> bool:
        """An idle worker re-offers its credit if Redis lost it (see ensure_credit.lua)."""
        credit_lists = [self.keys.credits(d) for d in await self.members("dispatcher")]
        offered = await self.scripts.ensure_credit(
            keys=[self.keys.ready, self.keys.batches, *credit_lists], args=[worker_id]
        )
        return bool(offered)

    async def pull_batch(self, worker_id: str, timeout_s: float) -> bytes | None:
        data: bytes | None = await self.redis.blmove(  # type: ignore[assignment]
            self.keys.batches,
            self.keys.processing(worker_id),
            timeout_s,  # type: ignore[arg-type]  # BLMOVE takes fractional seconds
            "RIGHT",
            "LEFT",
        )
        return data

    async def publish_and_finish(
        self, worker_id: str, replies: Mapping[str, wire.Reply], offer_credit: bool
    ) -> None:
        """Publish one reply per gateway, then ack the batch (and offer a credit).
        A crash between the two re-runs the batch; gateways ignore the duplicate."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for gateway_id, reply in replies.items():
                pipe.publish(self.keys.reply_channel(gateway_id), wire.encode(reply))
            await self.scripts.finish(
                keys=[self.keys.processing(worker_id), self.keys.ready],
                args=[worker_id, "1" if offer_credit else "0"],
                client=pipe,
            )
            await pipe.execute()

    # -- operators ----------------------------------------------------------

    async def stats(self) -> dict[str, int]:
        raw: dict[bytes, bytes] = await self.redis.hgetall(self.keys.stats)  # type: ignore[assignment]
        return {k.decode(): int(v) for k, v in raw.items()}


__all__ = ["Broker", "FleetSnapshot", "TakeResult", "connect"]
