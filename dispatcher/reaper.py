"""The reaper: recovers the work of processes whose heartbeat has expired.

At most one runs at a time, fleet-wide, under a Redis lock with a TTL; any
dispatcher may hold it. For each registered process whose heartbeat key is
gone:

- a dispatcher: its inflight envelopes go back to the FRONT of their tier
  queues and the credits it held go back to ``ready`` (``requeue.lua``);
- a worker: its credits are withdrawn, and the batch in its processing list
  goes back to ``batches`` with ``attempt + 1`` or, once the attempts reach
  the policy's ``workers.max_attempts``, to the capped dead-letter list, with
  every request in it answered ``INFERENCE_FAILED`` (``retry.lua``);
- a gateway: nothing to recover (its waiting connections died with it).

Then the process is dropped from its role's member set.
"""

import asyncio
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import msgspec
import redis.exceptions

from dispatcher import wire
from dispatcher.broker import Broker
from dispatcher.keys import ROLES
from infergate import clock, logs

log = logs.get(__name__)

DEAD_LETTER_CAP = 1_000


class Reaper:
    def __init__(
        self,
        broker: Broker,
        owner_id: str,
        max_attempts: Callable[[], int],
        interval_ms: int = 500,
        lock_ttl_ms: int = 3_000,
    ) -> None:
        self.broker = broker
        self.keys = broker.keys
        self.owner = owner_id
        self.max_attempts = max_attempts
        self.interval_s = interval_ms / 1000.0
        self.lock_ttl_ms = lock_ttl_ms
        self._task: asyncio.Task[Any] | None = None

    async def hold_lock(self) -> bool:
        """Take or extend the reaper lock; True while this process holds it."""
        r = self.broker.redis
        if await r.set(self.keys.reaper_lock, self.owner, nx=True, px=self.lock_ttl_ms):
            return True
        holder = await r.get(self.keys.reaper_lock)
        if holder == self.owner.encode():
            await r.pexpire(self.keys.reaper_lock, self.lock_ttl_ms)
            return True
        return False

    async def sweep(self) -> dict[str, int]:
        """One pass over every role; returns what it recovered."""
        done: dict[str, int] = defaultdict(int)
        for role in ROLES:
            members = await self.broker.members(role)
            if not members:
                continue
            beats = await self.broker.redis.mget([self.keys.heartbeat(role, m) for m in members])
            for member, beat in zip(members, beats, strict=True):
                if beat is not None:
                    continue
                if role == "dispatcher":
                    envs, credits = await self.broker.requeue(member)
                    done["envelopes_requeued"] += envs
                    if envs or credits:
                        log.warning(
                            "reaper.dispatcher_dead",
                            dispatcher_id=member,
                            requeued=envs,
                            credits=credits,
                        )
                elif role == "worker":
                    await self._recover_worker(member, done)
                await self.broker.redis.srem(self.keys.members(role), member)
                done[role + "s_reaped"] += 1
        return dict(done)

    async def _recover_worker(self, worker_id: str, done: dict[str, int]) -> None:
        r = self.broker.redis
        processing = self.keys.processing(worker_id)
        raw: bytes | None = await r.lindex(processing, -1)  # type: ignore[assignment]
        if raw is None:
            await r.lrem(self.keys.ready, 0, worker_id)
            return
        try:
            batch = wire.decode_batch(raw)
        except msgspec.DecodeError:
            log.error("reaper.batch_unreadable", worker_id=worker_id, size=len(raw))
            await self._move(worker_id, raw, b"")
            done["batches_dead_lettered"] += 1
            return
        attempt = batch.attempt + 1
        if attempt < self.max_attempts():
            retried = msgspec.structs.replace(batch, attempt=attempt)
            if await self._move(worker_id, raw, wire.encode(retried)):
                done["batches_retried"] += 1
                log.warning(
                    "reaper.batch_retried", worker_id=worker_id, batch_id=batch.id, attempt=attempt
                )
            return
        if await self._move(worker_id, raw, b""):
            done["batches_dead_lettered"] += 1
            log.error(
                "reaper.batch_dead_lettered",
                worker_id=worker_id,
                batch_id=batch.id,
                attempts=attempt,
            )
            await self._answer_failed(batch, attempt)

    async def _move(self, worker_id: str, raw: bytes, retried: bytes) -> bool:
        moved = await self.broker.scripts.retry(
            keys=[
                self.keys.processing(worker_id),
                self.keys.batches,
                self.keys.dead_letter,
                self.keys.ready,
                self.keys.stats,
            ],
            args=[raw, retried, worker_id, DEAD_LETTER_CAP],
        )
        return bool(moved)

    async def _answer_failed(self, batch: wire.Batch, attempts: int) -> None:
        by_gateway: dict[str, list[wire.Result]] = defaultdict(list)
        now_ms = clock.now_ms()
        for env in batch.envelopes:
            by_gateway[env.gateway].append(
                wire.Result(
                    id=env.id,
                    batch_id=batch.id,
                    batch_size=len(batch.envelopes),
                    worker="",
                    queue_ms=max(0, now_ms - env.enqueued_ms),
                    infer_ms=0,
                    error=wire.ErrorInfo(
                        "INFERENCE_FAILED",
                        f"the batch failed {attempts} times (its workers died or hung); not retried again",
                    ),
                )
            )
        async with self.broker.redis.pipeline(transaction=False) as pipe:
            for gateway_id, results in by_gateway.items():
                pipe.publish(self.keys.reply_channel(gateway_id), wire.encode(wire.Reply(results)))
            await pipe.execute()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="reaper")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        try:
            if await self.broker.redis.get(self.keys.reaper_lock) == self.owner.encode():
                await self.broker.redis.delete(self.keys.reaper_lock)
        except (redis.exceptions.RedisError, OSError):
            pass

    async def _run(self) -> None:
        while True:
            try:
                if await self.hold_lock():
                    recovered = await self.sweep()
                    if recovered:
                        log.info("reaper.sweep", **recovered)
            except (redis.exceptions.RedisError, OSError) as exc:
                log.warning("reaper.redis_unavailable", error=type(exc).__name__)
            except Exception:
                log.exception("reaper.failed")
            await asyncio.sleep(self.interval_s)
