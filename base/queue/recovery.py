"""What recovery may do in Redis: the reaper's lock, finding processes whose
heartbeat expired, returning a dead dispatcher's envelopes, and retrying or
dead-lettering a dead worker's batches (answering their requests when it
gives up). A worker starting under an id that still holds a batch recovers it
the same way."""

import msgspec
from infergate.base import clock, logs, wire
from infergate.base.queue.dead_letters import DEAD_LETTER_CAP
from infergate.base.queue.dispatcher import requeue
from infergate.base.queue.replies import deliver_replies, failure_replies
from infergate.base.queue.scripts import execute
from infergate.base.queue.store import Store
from infergate.base.queue.worker import hand_back
from redis.asyncio.client import Pipeline

log = logs.get(__name__)


class RecoveryQueue:
    def __init__(self, store: Store, owner_id: str) -> None:
        self.store = store
        self.keys = store.keys
        self.owner_id = owner_id

    # -- the lock, and who is dead ---------------------------------------------

    async def look(self, roles: tuple[str, ...], ttl_ms: int) -> dict[str, list[str]] | None:
        """With the fleet-wide reaper lock held (taken, or extended: one
        owner at a time), the registered processes of ``roles`` that are
        dead (``expired``); None while another owner holds it. One round
        trip (``reap.lua``)."""
        members, prefixes = self.store.beats_named(list(roles))
        reply = await self.store.pipelined.call(
            self.store.scripts.reap,
            [self.keys.reaper_lock, *members],
            [self.owner_id, ttl_ms, *prefixes],
        )
        if reply is None:
            return None
        return await self._dead(await self.store.beats_of(list(roles), reply))

    async def release_lock(self) -> None:
        await self.store.scripts.release_lock(keys=[self.keys.reaper_lock], args=[self.owner_id])

    async def expired(self, roles: tuple[str, ...]) -> dict[str, list[str]]:
        """Registered processes whose heartbeat has expired, or is unreadable
        (a corrupt heartbeat is deleted: its owner, if alive, writes a new one)."""
        beats, _ = await self.store.heartbeats(roles)
        return await self._dead(beats)

    async def _dead(self, beats: dict[str, dict[str, bytes | None]]) -> dict[str, list[str]]:
        dead: dict[str, list[str]] = {}
        for role, by_id in beats.items():
            for process_id, value in by_id.items():
                if value is not None and _readable(value):
                    continue
                if value is not None:
                    await self.store.redis.delete(self.keys.heartbeat(role, process_id))
                dead.setdefault(role, []).append(process_id)
        return dead

    async def forget(self, role: str, process_id: str) -> None:
        await self.store.redis.srem(self.keys.members(role), process_id)

    # -- recovering their work -------------------------------------------------

    async def requeue_dispatcher(self, dispatcher_id: str) -> tuple[int, int]:
        return await requeue(self.store, dispatcher_id)

    async def recover_worker(self, worker_id: str, max_attempts: int) -> list[str]:
        """Every batch a worker left in processing (two at most: the one it
        ran and had not yet answered, and the next one it had started) is
        recovered, oldest first (``recover_batch``); then its credit is
        withdrawn. Returns what happened to each, [] if it held none. The
        newest goes back first, so the older runs first."""
        outcomes: list[str] = []
        while (outcome := await self.recover_batch(worker_id, max_attempts)) != "idle":
            outcomes.append(outcome)
        return outcomes

    async def recover_batch(self, worker_id: str, max_attempts: int) -> str:
        """The newest batch a worker left in processing runs again with
        attempt + 1 (``retry.lua``: handed to an idle worker, or put on the
        shared ``batches``), or past ``max_attempts`` goes to the
        dead-letter list with every request in it answered INFERENCE_FAILED.
        Returns what happened: 'idle' (none left; its credit is withdrawn
        and its last step forgotten), 'retried', 'dead_lettered' or
        'moved_already'."""
        raw: bytes | None = await self.store.redis.lindex(  # type: ignore[assignment]
            self.keys.processing(worker_id), 0
        )
        if raw is None:
            keys, store = self.keys, self.store

            def build(pipe: Pipeline) -> None:
                pipe.lrem(keys.ready, 0, worker_id)
                pipe.delete(keys.last_step(worker_id))
                hand_back(pipe, store, worker_id)  # handed to it, never pulled

            await execute(store.redis, store.scripts, build, transaction=False)
            return "idle"
        try:
            batch, _ = wire.decode_batch(raw)
        except msgspec.DecodeError:
            log.error("recovery.batch_unreadable", worker_id=worker_id, size=len(raw))
            return "dead_lettered" if await self._move(worker_id, raw, b"") else "moved_already"
        attempt = batch.attempt + 1
        if attempt < max_attempts:
            if not await self._move(worker_id, raw, wire.retried_batch(raw)):
                return "moved_already"
            log.warning(
                "recovery.batch_retried", worker_id=worker_id, batch_id=batch.id, attempt=attempt
            )
            return "retried"
        # Answer first, then move: if the answer cannot be published the batch
        # stays where it is and the next sweep tries again (a duplicate answer
        # is ignored by its gateway; a lost one would leave clients to time out).
        now_ms = clock.now_ms()
        replies = failure_replies(
            batch,
            "INFERENCE_FAILED",
            f"the batch failed {attempt} times (its workers died or hung); not retried again",
            worker_id="",
            now_ms=now_ms,
        )
        await execute(
            self.store.redis,
            self.store.scripts,
            lambda pipe: deliver_replies(pipe, self.store, replies, now_ms),
            transaction=False,
        )
        if not await self._move(worker_id, raw, b""):
            return "moved_already"
        log.error(
            "recovery.batch_dead_lettered", worker_id=worker_id, batch_id=batch.id, attempts=attempt
        )
        return "dead_lettered"

    async def dead_letter_unreadable(self, worker_id: str, raw: bytes) -> None:
        """A worker could not read the batch it pulled: keep it for an operator."""
        await self._move(worker_id, raw, b"")

    async def _move(self, worker_id: str, raw: bytes, retried: bytes) -> bool:
        moved = await self.store.scripts.retry(
            keys=[
                self.keys.processing(worker_id),
                self.keys.batches,
                self.keys.dead_letter,
                self.keys.ready,
                self.keys.stats,
            ],
            args=[
                raw,
                retried,
                worker_id,
                DEAD_LETTER_CAP,
                self.keys.heartbeat("worker", ""),
                self.keys.handoff(""),
            ],
        )
        return bool(moved)


def _readable(value: bytes) -> bool:
    try:
        wire.decode_heartbeat(value)
    except msgspec.DecodeError:
        return False
    return True
