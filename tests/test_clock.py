"""The fleet's clock: which of Redis's TIME samples a process keeps."""

import time
from collections.abc import Iterator

import pytest
from infergate.base import clock


@pytest.fixture(autouse=True)
def fresh_clock() -> Iterator[None]:
    saved = (clock._base_ns, clock._round_trip_ns, list(clock._recent))
    clock._recent.clear()
    yield
    clock._base_ns, clock._round_trip_ns = saved[0], saved[1]
    clock._recent.clear()
    clock._recent.extend(saved[2])


def test_the_shortest_round_trip_of_the_recent_samples_is_kept() -> None:
    clock._sampled(400_000, 10_000_000)
    clock._sampled(100_000, 10_050_000)  # (within both bounds: the same clock)
    clock._sampled(900_000, 9_800_000)
    assert (clock._round_trip_ns, clock._base_ns) == (100_000, 10_050_000)
    for _ in range(clock.RECENT_SAMPLES):  # the short one ages out
        clock._sampled(300_000, 10_000_000)
    assert clock._round_trip_ns == 300_000


def test_a_sample_no_bound_reconciles_with_the_kept_one_is_taken_at_once() -> None:
    """Redis's clock stepped by 2 s (a failover to another host): the next
    sample is taken, however long its round trip, and the old ones dropped."""
    clock._sampled(100_000, 10_000_000)
    clock._sampled(5_000_000, 2_010_000_000)
    assert (clock._round_trip_ns, clock._base_ns) == (5_000_000, 2_010_000_000)
    assert len(clock._recent) == 1


async def test_one_align_reads_time_once_and_follows_redis() -> None:
    calls = 0
    redis_ahead_s = 7

    async def read_time() -> tuple[int, int]:
        nonlocal calls
        calls += 1
        ns = time.time_ns() + redis_ahead_s * 1_000_000_000
        return ns // 1_000_000_000, (ns // 1_000) % 1_000_000

    await clock.align(read_time)
    assert calls == 1
    assert clock.aligned()
    assert abs(clock.offset_ms() - redis_ahead_s * 1000) < 50
