"""Supervised background loops, one-off background steps, and the one
backoff every retry uses.

Each periodic task of a process (heartbeat, fleet view, reply listener,
policy watcher, reaper) is a ``Supervised`` loop around one ``step``. A step
that fails does not end the loop: Redis being away is logged once per
outage and retried with backoff; anything else is logged with its stack
every time it happens (at most once per backoff cap) and retried the same
way. ``healthy`` says whether the last step succeeded, so readiness can
report a loop that keeps failing instead of serving on a frozen view.
"""

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from infergate.base import logs
from infergate.base.errors import UNAVAILABLE, out_of_memory

log = logs.get(__name__)


class Backoff:
    """Exponential backoff with jitter: ``base_s``, doubling, up to ``cap_s``."""

    def __init__(self, base_s: float = 0.05, cap_s: float = 2.0) -> None:
        self.base_s = base_s
        self.cap_s = cap_s
        self.failures = 0

    def next_s(self) -> float:
        delay = min(self.cap_s, self.base_s * 2 ** min(self.failures, 30))
        self.failures += 1
        return float(delay * random.uniform(0.5, 1.0))

    def reset(self) -> None:
        self.failures = 0

    async def sleep(self) -> float:
        delay = self.next_s()
        await asyncio.sleep(delay)
        return delay


Step = Callable[[], Awaitable[Any]]

# A process's periodic loops step on one grid (its phase drawn at start, so
# processes do not all wake at once): loops whose intervals are multiples of
# one another wake together, in one turn of the event loop, and a process
# at rest wakes once for all of them, not once for each.
_PHASE_S = random.uniform(0.0, 60.0)
# A tick closer than this is the one just stepped (a timer may fire a hair early).
_SAME_TICK_S = 0.001


def until_next_tick(interval_s: float) -> float:
    """Seconds to the next multiple of ``interval_s`` on the process's grid
    (the event loop's clock: what its timers are set on)."""
    now = asyncio.get_running_loop().time()
    wait = interval_s - (now + _PHASE_S) % interval_s
    return wait + interval_s if wait < _SAME_TICK_S else wait


class Background:
    """One-off steps run beside their caller: each task is kept until it
    ends (the event loop holds only a weak reference to a task), and one
    that fails is logged as ``event``; ``settled`` waits for those under way."""

    def __init__(self, event: str, level: str = "error") -> None:
        self.event = event
        self.level = level
        self.tasks: set[asyncio.Task[None]] = set()

    def run(self, step: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(step)
        self.tasks.add(task)
        task.add_done_callback(self._ended)

    def _ended(self, task: "asyncio.Task[None]") -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            getattr(log, self.level)(self.event, error=type(task.exception()).__name__)

    async def settled(self) -> None:
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)


class Supervised:
    """Runs ``step`` every ``interval_s`` (0: again at once), on the
    process's grid (``until_next_tick``), until stopped. ``hasten`` sets a
    shorter interval that the wait under way already follows."""

    def __init__(
        self, name: str, step: Step, interval_s: float, backoff: Backoff | None = None
    ) -> None:
        self.name = name
        self.step = step
        self.interval_s = interval_s
        self.backoff = backoff or Backoff()
        self.healthy = False
        self.errors = 0
        # When a step last ended, failed or not (monotonic s): a loop that
        # stops ending steps is stuck, whatever Redis does.
        self.last_step_s = 0.0
        self.last_ok_s = 0.0  # when a step last succeeded (monotonic s)
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        # The wait for the next tick, while one is under way.
        self._pause: asyncio.Future[None] | None = None
        self._tick: asyncio.TimerHandle | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=self.name)
        self._task.add_done_callback(self._ended)

    async def stop(self) -> None:
        """Cancel the loop and wait until it has ended. A cancellation can be
        lost inside a library (seen: redis-py under Python 3.11 returning a
        result to a task cancelled while it waited), so the loop also checks a
        flag, and the task is cancelled again until it ends."""
        task, self._task = self._task, None
        if task is None:
            return
        self._stopping = True
        while not task.done():
            task.cancel()
            await asyncio.wait([task], timeout=0.5)

    def _ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and not self._stopping:
            # Only a BaseException other than cancellation gets here (the
            # loop never returns unless stopped): say so loudly, never silently.
            log.error("loop.ended", loop=self.name, error=repr(task.exception()))
            self.healthy = False

    async def _run(self) -> None:
        while not self._stopping:
            try:
                await self.step()
            except UNAVAILABLE as exc:
                self.last_step_s = time.monotonic()
                if self.healthy or self.backoff.failures == 0:
                    log.warning("loop.redis_unavailable", loop=self.name, error=type(exc).__name__)
                self.healthy = False
                await self.backoff.sleep()
                continue
            except Exception as exc:
                self.last_step_s = time.monotonic()
                self.healthy = False
                if out_of_memory(exc):  # Redis is there but full: said once, no stack
                    if self.backoff.failures == 0:
                        log.warning("loop.redis_full", loop=self.name)
                else:
                    self.errors += 1
                    log.exception("loop.failed", loop=self.name, errors=self.errors)
                await self.backoff.sleep()
                continue
            self.last_step_s = self.last_ok_s = time.monotonic()
            if not self.healthy and self.backoff.failures:
                log.info("loop.recovered", loop=self.name)
            self.healthy = True
            self.backoff.reset()
            if self.interval_s > 0:
                await self._until_tick()

    async def _until_tick(self) -> None:
        """What ``asyncio.sleep`` does until the next tick, with the timer
        kept, so that ``hasten`` can set it sooner."""
        loop = asyncio.get_running_loop()
        self._pause = pause = loop.create_future()
        self._tick = loop.call_later(until_next_tick(self.interval_s), _end_pause, pause)
        try:
            await pause
        finally:
            self._tick.cancel()
            self._pause = self._tick = None

    def hasten(self, interval_s: float) -> None:
        """Step every ``interval_s`` from now on: a wait under way ends at
        its next tick, if that is sooner than the one it waits for."""
        self.interval_s = interval_s
        pause, tick = self._pause, self._tick
        if pause is None or tick is None or pause.done():
            return
        loop = asyncio.get_running_loop()
        sooner = until_next_tick(interval_s)
        if loop.time() + sooner < tick.when():
            tick.cancel()
            self._tick = loop.call_later(sooner, _end_pause, pause)


def _end_pause(pause: "asyncio.Future[None]") -> None:
    if not pause.done():
        pause.set_result(None)


async def retry_until_done(
    what: str,
    step: Step,
    stop: asyncio.Event | None = None,
    grace_after_stop_s: float | Callable[[], float] = 0.0,
    backoff: Backoff | None = None,
) -> bool:
    """Run ``step`` until it succeeds, with backoff between failures, and
    return True. Once ``stop`` is set, keep trying for ``grace_after_stop_s``
    more (a function: asked when a failure first finds ``stop`` set), then
    return False. Every failure is logged; none is swallowed."""
    backoff = backoff or Backoff(base_s=0.05, cap_s=2.0)
    stopped_at: float | None = None
    grace_s = 0.0
    while True:
        try:
            await step()
            return True
        except UNAVAILABLE as exc:
            log.warning("retry.redis_unavailable", what=what, error=type(exc).__name__)
        except Exception as exc:
            if out_of_memory(exc):  # Redis is there but full: no stack, a line a second
                logs.limited(log, "retry.redis_full", level="warning", what=what)
            else:
                log.exception("retry.failed", what=what)
        if stop is not None and stop.is_set():
            now = asyncio.get_running_loop().time()
            if stopped_at is None:
                stopped_at = now
                grace = grace_after_stop_s
                grace_s = grace() if callable(grace) else grace
            if now - stopped_at >= grace_s:
                return False
        await backoff.sleep()
