"""Heartbeats: every process keeps a key with a TTL; the reaper treats an
owner whose key has expired (or is unreadable) as dead. The same loop keeps
the process on the fleet's clock (``clock.align``): first, before the first
beat, then every ``ALIGN_EVERY_S``.

A beat that may rest (a gateway's, for one model: its death leaves nothing
to recover) comes ``REST`` times less often, with a TTL as much longer,
while it says nothing new but the time; ``stir`` brings the next one back
to the next tick of the interval. At rest a process costs what it wakes
for, and a policy of many models has a beat for each of them. A process
whose death would leave work to recover (a dispatcher holding a credit)
rests only while it holds none, and beats with the short TTL again before
it takes any (``before_holding``): what it leaves is found as soon as ever.
"""

import time
from collections.abc import Callable

import msgspec
from infergate.base import clock, logs, wire
from infergate.base.loops import Backoff, Supervised
from infergate.base.queue.store import Store

log = logs.get(__name__)

# Often enough that a step of Redis's clock reaches every process within a
# couple of seconds (a TIME each time; three the first, before the first beat).
ALIGN_EVERY_S = 2.0
FIRST_ALIGN_SAMPLES = 3
# A clock off Redis's is said again this often, or when the offset moves.
OFF_LOG_EVERY_S = 60.0
OFF_LOG_MOVE_MS = 100.0
# How many times less often a beat that says nothing new comes, and how
# much longer its key lives (the same ratio: as many beats to a TTL).
REST = 4


class Heartbeater:
    """Beats every ``interval_ms`` with whatever ``status()`` returns (with
    ``rests``, ``REST`` times less often while it says nothing new and
    ``holds()`` says it holds nothing a death would leave).

    A failed beat (Redis away) is logged and retried with backoff, never
    slower than the interval; the process keeps running and its key simply
    expires if Redis stays away.
    """

    def __init__(
        self,
        store: Store,
        status: Callable[[], wire.Heartbeat],
        interval_ms: int,
        ttl_ms: int,
        rests: bool = False,
        holds: Callable[[], bool] = lambda: False,
    ) -> None:
        self.store = store
        self.status = status
        self.ttl_ms = ttl_ms
        self.rests = rests
        self.holds = holds
        self.resting = False
        self._said = b""  # the last beat written, but for its time
        self._ttl_written_ms = ttl_ms
        self._ttl_sent_ms = ttl_ms
        self._written_at_s = 0.0  # (monotonic: a beat outside the loop counts too)
        interval_s = self.interval_s = interval_ms / 1000.0
        # Generous: a beat that waits on a dead Redis takes up to its socket timeout.
        self.max_silence_s = max(10.0, 20 * interval_s)
        self._align_at = 0.0  # monotonic s: at once, before the first beat
        self._off_said = (0.0, -OFF_LOG_EVERY_S)  # the offset last logged, and when
        self.loop = Supervised(
            "heartbeat", self.beat_once, interval_s, Backoff(base_s=0.05, cap_s=interval_s)
        )

    @property
    def healthy(self) -> bool:
        """The last beat reached Redis, and recently: within the TTL (a
        Redis that hangs fails no step until the socket times out)."""
        last_ok_s = max(self.loop.last_ok_s, self._written_at_s)
        fresh = time.monotonic() - last_ok_s < self._ttl_written_ms / 1000.0
        return self.loop.healthy and fresh

    def alive(self) -> bool:
        """The loop still ends a beat (failed or not) every few intervals:
        the event loop is not stuck. Before the first beat: alive."""
        last = self.loop.last_step_s
        return last == 0.0 or time.monotonic() - last < self.max_silence_s

    async def beat_once(self) -> None:
        if time.monotonic() >= self._align_at:
            await self._align()
        beat = self.status()
        said = self._said_of(beat)
        # (set before the write: a stir while it is under way wins)
        self.resting = self.rests and said == self._said and not self.holds()
        self.loop.interval_s = self.interval_s * REST if self.resting else self.interval_s
        await self._beat(beat, said, self.ttl_ms * REST if self.resting else self.ttl_ms)

    async def _beat(self, beat: wire.Heartbeat, said: bytes, ttl_ms: int) -> None:
        # The longest TTL that may stand in Redis: one under way may land
        # (or may have, if its reply was lost) until a later beat is written.
        self._ttl_sent_ms = max(self._ttl_sent_ms, ttl_ms)
        await self.store.beat(beat, ttl_ms)
        self._said, self._ttl_written_ms = said, ttl_ms
        self._ttl_sent_ms = ttl_ms  # (earlier writes on the connection landed before it)
        self._written_at_s = time.monotonic()

    async def before_holding(self) -> None:
        """The process is about to hold what its death would leave (``holds()``
        says so from now on): a resting beat, written or under way, is
        followed now by one with the short TTL, on the same connection, so
        it lands after it; the next ones come at the interval again."""
        self.stir()
        if self._ttl_sent_ms > self.ttl_ms:
            beat = self.status()
            await self._beat(beat, self._said_of(beat), self.ttl_ms)

    def _said_of(self, beat: wire.Heartbeat) -> bytes:
        """What a beat says but for its time (what a resting beat compares)."""
        return wire.encode(msgspec.structs.replace(beat, beat_ms=0)) if self.rests else b""

    def stir(self) -> None:
        """There is something new to say: a resting beat comes back to the
        interval, the next one at its next tick."""
        if self.resting:
            self.resting = False
            self.loop.hasten(self.interval_s)

    async def _align(self) -> None:
        samples = 1 if clock.aligned() else FIRST_ALIGN_SAMPLES
        round_trip_ms = await clock.align(self.store.redis.time, samples)
        now = time.monotonic()
        self._align_at = now + ALIGN_EVERY_S
        offset_ms = clock.offset_ms()
        said_ms, said_at = self._off_said
        if abs(offset_ms) > clock.OFF_WARN_MS and (
            now - said_at > OFF_LOG_EVERY_S or abs(offset_ms - said_ms) > OFF_LOG_MOVE_MS
        ):
            self._off_said = (offset_ms, now)
            # Deadlines still hold (they follow Redis's clock), but this
            # host's logs and anything else reading its clock are off.
            log.warning(
                "clock.off",
                offset_ms=round(offset_ms),
                round_trip_ms=round(round_trip_ms, 2),
                note="this host's clock is off Redis's; deadlines follow Redis's",
            )

    def start(self) -> None:
        self.loop.start()

    async def stop(self) -> None:
        await self.loop.stop()
