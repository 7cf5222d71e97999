"""A key's limits (window.lua, as admit_request.lua checks and charges them)
against a reference model of the sliding window written here in Python:
the same replies and the same buckets in Redis, over sequences of charges,
refunds, settlements and steps of time that hypothesis makes up. Time is stepped by a
test entry (tests/lua/charge_at.lua) over the production libraries: the
admit itself reads Redis's clock, which a test cannot step."""

import math
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from infergate.base.queue import scripts

HARNESS = Path(__file__).parent / "lua" / "charge_at.lua"
# Three limits of a key, as a tier's "10 per 10 s" and "24 per 25 s" would be
# (a tenth over the limit counts from 10 up), and a token limit's hard
# "12 per 10 s" (none over it).
LIMITS = ((10, 10.0, False), (24, 25.0, False), (12, 10.0, True))
HARD = 2  # (the token limit's index)


@dataclass
class Window:
    """The sliding window as window.lua documents it: ten buckets of a tenth
    of the window each, plus the oldest one in full (eleven)."""

    amount: int
    window_ms: int
    hard: bool = False
    buckets: dict[int, int] = field(default_factory=dict)

    def _sum(self, first: int, last: int) -> int:
        return sum(self.buckets.get(i, 0) for i in range(first, last + 1))

    def check(self, now: int, cost: int) -> tuple[bool, int, int]:
        """Whether ``cost`` fits; the last ten buckets' sum; the ms of the
        reply as if refused (until room, or until the window empties)."""
        current = now * 10 // self.window_ms
        allowed = self.amount if self.hard else self.amount + self.amount // 10
        if self._sum(current - 10, current) < -allowed:
            self.buckets.clear()  # (below what refunds can leave: planted, it starts over)
        eleven, ten = self._sum(current - 10, current), self._sum(current - 9, current)
        reset = math.ceil((current + 10) * self.window_ms / 10) - now
        if cost <= 0:
            return True, ten, reset if eleven != 0 else -2
        if eleven + cost <= allowed and ten + cost <= self.amount:
            return True, ten, reset if eleven != 0 else -2
        for later in range(1, 12):
            e = self._sum(current - 10 + later, current)
            t = self._sum(current - 9 + later, current)
            if e + cost <= allowed and t + cost <= self.amount:
                return False, ten, math.ceil((current + later) * self.window_ms / 10) - now
        return False, ten, self.window_ms

    def charge(self, now: int, cost: int) -> None:
        current = now * 10 // self.window_ms
        self.buckets[current] = self.buckets.get(current, 0) + cost

    def settle(self, now: int, bucket: int, back: int) -> None:
        """What a reservation charged in ``bucket`` did not use, given back
        (a bucket out of the window has nothing to give back to)."""
        current = now * 10 // self.window_ms
        if bucket >= current - 10 and bucket in self.buckets:
            # (never more than it or the window holds: refunds, charges of
            # minus the cost, can leave either below what was reserved; a
            # negative give-back is an excess, charged whole)
            given = back
            if back > 0:
                given = min(back, self.buckets[bucket], self._sum(current - 10, current))
                given = max(given, 0)
            self.buckets[bucket] -= given

    def held(self, now: int) -> dict[int, int]:
        """What Redis must hold: every bucket of the eleven charged in."""
        current = now * 10 // self.window_ms
        return {i: v for i, v in self.buckets.items() if current - 10 <= i <= current}


def reference(windows: list[Window], now: int, costs: list[int]) -> list[int]:
    checks = [w.check(now, c) for w, c in zip(windows, costs, strict=True)]
    refused = [i for i, (fits, _, _) in enumerate(checks) if not fits]
    reply = [0 if refused else 1, 0, 0]
    for w, cost, (_, ten, ms) in zip(windows, costs, checks, strict=True):
        if not refused:
            w.charge(now, cost)
            ten += cost
            if ms < 0:
                ms = math.ceil((now * 10 // w.window_ms + 10) * w.window_ms / 10) - now
        reply += [ten, ms]
    return [*reply, refused[0] + 1 if refused else 0]


STEPS = st.lists(
    st.tuples(
        # ms since the last request: mostly within a bucket (1 s), at times past many
        st.one_of(st.integers(0, 400), st.integers(0, 400), st.integers(0, 12_000)),
        st.lists(st.integers(-2, 6), min_size=3, max_size=3),  # each limit's cost
        st.integers(-3, 6),  # given back to the oldest reservation not settled (<0: an excess)
    ),
    min_size=1,
    max_size=60,
)


@pytest.fixture(scope="module")
def client(module_redis) -> redis.Redis:
    client = redis.Redis.from_url(module_redis.url)
    yield client
    client.close()


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(steps=STEPS, start=st.integers(0, 10**6))
def test_the_windows_keep_the_reference_model(
    client: redis.Redis, steps: list[tuple[int, list[int], int]], start: int
) -> None:
    charge = client.register_script(scripts.libraries("admit") + "\n" + HARNESS.read_text("utf-8"))
    settle = client.register_script(scripts.source("settle"))
    keys = [f"window:{start}:{i}" for i in range(len(LIMITS))]
    client.delete(*keys)
    windows = [Window(amount, round(s * 1000), hard) for amount, s, hard in LIMITS]
    reserved: list[tuple[int, int]] = []  # (bucket, tokens) not settled yet
    now = 1_700_000_000_000 + start
    for step, (elapsed, costs, back) in enumerate(steps):
        now += elapsed
        args = [now]
        for (amount, window_s, hard), cost in zip(LIMITS, costs, strict=True):
            args += [cost, amount, amount if hard else amount + amount // 10, window_s, 0]
        got = [int(x) for x in charge(keys=keys, args=args)]
        assert got == reference(windows, now, costs), (step, now, costs)
        token_window = windows[HARD]
        if got[0] == 1 and costs[HARD] > 0:
            reserved.append((now * 10 // token_window.window_ms, costs[HARD]))
        if back and reserved:
            bucket, tokens = reserved.pop(0)
            back = min(back, tokens)
            settle(keys=[keys[HARD]], args=[bucket, back, tokens])
            token_window.settle(now, bucket, back)
        for key, w in zip(keys, windows, strict=True):
            stored = {
                int(k): int(v) for k, v in client.hgetall(key).items() if k not in (b"l", b"s")
            }
            assert {i: v for i, v in stored.items() if v} == {
                i: v for i, v in w.held(now).items() if v
            }, (step, key)
    client.delete(*keys)
