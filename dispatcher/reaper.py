"""The reaper: recovers the work of processes whose heartbeat has expired.

At most one runs at a time, fleet-wide, under a Redis lock with a TTL
(taken, extended and released under its owner's token, ``lock.lua``; the
look at who is dead is taken with it, in one step: ``reap.lua``); any
dispatcher may hold it. For each registered process whose heartbeat key is gone (or
unreadable):

- a dispatcher: the credits it held go back to ``ready`` (it holds no
  envelopes: a batch is formed and handed off in one step; an inflight list
  left by an earlier version goes back to the FRONT of its tier queues);
- a worker: its credits are withdrawn, and each batch in its processing
  list (two at most: one run but not yet answered, and the next) runs
  again with ``attempt + 1``, handed to an idle worker (its credit pays)
  or, with none idle, put on the shared ``batches``; or, once the attempts
  reach the policy's ``workers.max_attempts``, it goes to the capped
  dead-letter list, with every request in it answered ``INFERENCE_FAILED``.
  What was handed to it and never pulled goes to ``batches`` as it was;
- a gateway: nothing to recover (its waiting connections died with it).

Then the process is dropped from its role's member set.
"""

import contextlib
from collections import Counter
from collections.abc import Callable

from infergate.base import logs
from infergate.base.errors import STORE_ERRORS
from infergate.base.loops import Supervised
from infergate.base.metrics import DispatcherMetrics
from infergate.base.queue.recovery import RecoveryQueue
from infergate.base.tiers import ROLES

log = logs.get(__name__)


class Reaper:
    def __init__(
        self,
        recovery: RecoveryQueue,
        max_attempts: Callable[[], int],
        metrics: DispatcherMetrics | None = None,
        interval_ms: int = 500,
        lock_ttl_ms: int = 3_000,
    ) -> None:
        self.recovery = recovery
        self.max_attempts = max_attempts
        self.metrics = metrics
        self.lock_ttl_ms = lock_ttl_ms
        self.loop = Supervised("reaper", self.run_once, interval_ms / 1000.0)

    async def run_once(self) -> None:
        if self.recovery.store.full:
            # Redis refuses writes: a heartbeat that could not be written is
            # no death (each process extends its key's TTL instead, but one
            # that could not is judged once Redis has room again).
            return
        dead = await self.recovery.look(ROLES, self.lock_ttl_ms)
        if dead is not None:
            recovered = await self.sweep(dead)
            if recovered:
                log.info("reaper.sweep", **recovered)
                self._count(recovered)

    def _count(self, recovered: dict[str, int]) -> None:
        if self.metrics is None:
            return
        self.metrics.batches_retried.inc(recovered.get("batches_retried", 0))
        self.metrics.batches_dead_lettered.inc(recovered.get("batches_dead_lettered", 0))
        self.metrics.envelopes_requeued.inc(recovered.get("envelopes_requeued", 0))

    async def sweep(self, dead_by_role: dict[str, list[str]]) -> dict[str, int]:
        """Recover what the dead left, every role; returns what it recovered."""
        done: Counter[str] = Counter()
        for role, dead in dead_by_role.items():
            for process_id in dead:
                if role == "dispatcher":
                    envs, credits = await self.recovery.requeue_dispatcher(process_id)
                    done["envelopes_requeued"] += envs
                    if envs or credits:
                        log.warning(
                            "reaper.dispatcher_dead",
                            dispatcher_id=process_id,
                            requeued=envs,
                            credits=credits,
                        )
                elif role == "worker":
                    outcomes = await self.recovery.recover_worker(process_id, self.max_attempts())
                    for outcome in outcomes:
                        if outcome in ("retried", "dead_lettered"):
                            done["batches_" + outcome] += 1
                await self.recovery.forget(role, process_id)
                done[role + "s_reaped"] += 1
        return dict(done)

    def start(self) -> None:
        self.loop.start()

    async def stop(self) -> None:
        await self.loop.stop()
        with contextlib.suppress(*STORE_ERRORS):
            await self.recovery.release_lock()
