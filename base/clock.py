"""The one clock: Redis's.

Deadlines, heartbeats and job times travel between processes as epoch
milliseconds, so every process must read them on the same clock. Hosts'
clocks disagree (a worker 3 s ahead took every request with less than 3 s
left as expired), so the fleet's clock is Redis's: each process measures
Redis's ``TIME`` against its own monotonic clock (``align``, from its
heartbeat loop, every few seconds: a ``TIME`` each, the best of the last
few kept) and ``now_ms`` carries its monotonic clock onto Redis's epoch. A
host's wall clock may be off, or step, without effect; what is left is the
measurement's error, under half a round trip to Redis. Durations inside a
process use ``time.monotonic()``.
"""

import time
from collections import deque
from collections.abc import Awaitable, Callable

# Redis's epoch (ns) minus this host's monotonic clock (ns): until the
# first ``align``, this host's wall clock stands in.
_base_ns = time.time_ns() - time.monotonic_ns()
_round_trip_ns: int | None = None  # of the sample in use; None: never aligned

# An offset past this is a host clock worth fixing: logged, and in
# ``infergate_clock_offset_seconds``.
OFF_WARN_MS = 500


def now_ms() -> int:
    """The fleet's time (Redis's) as integer epoch milliseconds, for the wire."""
    return (time.monotonic_ns() + _base_ns) // 1_000_000


def offset_ms() -> float:
    """Redis's clock minus this host's wall clock, in ms (0 before ``align``)."""
    return (time.monotonic_ns() + _base_ns - time.time_ns()) / 1e6


def aligned() -> bool:
    return _round_trip_ns is not None


# The samples ``align`` chooses among: one an alignment, the last few.
RECENT_SAMPLES = 3
_recent: deque[tuple[int, int]] = deque(maxlen=RECENT_SAMPLES)  # (round trip, base) ns


async def align(read_time: Callable[[], Awaitable[tuple[int, int]]], samples: int = 1) -> float:
    """Measure Redis's clock (``read_time``: its ``TIME``, seconds and
    microseconds) against this host's ``samples`` times, and keep, of the
    recent samples, the one with the shortest round trip; returns that
    round trip in ms."""
    for _ in range(samples):
        before = time.monotonic_ns()
        seconds, micros = await read_time()
        after = time.monotonic_ns()
        redis_ns = int(seconds) * 1_000_000_000 + int(micros) * 1_000
        _sampled(after - before, redis_ns - (before + after) // 2)
    assert _round_trip_ns is not None
    return _round_trip_ns / 1e6


def _sampled(trip_ns: int, base_ns: int) -> None:
    """A sample is off the true base by at most half its round trip. One
    that two such bounds cannot reconcile with an earlier one says Redis's
    clock moved (a step, a failover to another host): the samples before it
    are dropped, so the move is taken at once."""
    global _base_ns, _round_trip_ns
    if any(abs(base_ns - base) > (trip_ns + trip) // 2 for trip, base in _recent):
        _recent.clear()
    _recent.append((trip_ns, base_ns))
    _round_trip_ns, _base_ns = min(_recent)


def monotonic_s() -> float:
    """Monotonic seconds, for measuring durations inside one process."""
    return time.monotonic()


def elapsed_ms(since_monotonic_s: float) -> float:
    """Milliseconds since a ``monotonic_s()`` reading."""
    return (time.monotonic() - since_monotonic_s) * 1000.0


def elapsed_s(since_monotonic_s: float) -> float:
    """Seconds since a ``monotonic_s()`` reading."""
    return time.monotonic() - since_monotonic_s
