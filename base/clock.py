"""The one clock helper.

Deadlines travel on the wire as epoch milliseconds (every process agrees on
them); durations inside a process are measured with ``time.monotonic()``.
"""

import time


def now_ms() -> int:
    """Wall-clock time as integer epoch milliseconds, for the wire."""
    return time.time_ns() // 1_000_000


def monotonic_s() -> float:
    """Monotonic seconds, for measuring durations inside one process."""
    return time.monotonic()


def elapsed_ms(since_monotonic_s: float) -> float:
    """Milliseconds since a ``monotonic_s()`` reading."""
    return (time.monotonic() - since_monotonic_s) * 1000.0


def elapsed_s(since_monotonic_s: float) -> float:
    """Seconds since a ``monotonic_s()`` reading."""
    return time.monotonic() - since_monotonic_s
