"""A gateway's admits gathered into calls of admit.lua (queue/admits.py),
against a real Redis: each request is charged as if it came alone, one
request's failure fails only it, and nothing waits past a call."""

import asyncio
import time

import pytest
from infergate.base import clock, wire
from infergate.base.errors import out_of_memory
from infergate.base.queue.admits import MOST, MOST_BYTES, Admits
from infergate.base.queue.gateway import Admitted, Counter, GatewayQueue, Place
from infergate.base.queue.inputs import Beside
from infergate.base.queue.store import Store
from infergate.redis_server import RedisServer
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, ResponseError

from tests.helpers import evalsha_calls


def env(i: int) -> bytes:
    now = clock.now_ms()
    return wire.encode(wire.Envelope(f"r{i}", "gw", "free", "k", f"in{i}", now, now + 10_000))


@pytest.fixture
async def store(redis_url: str):
    store = Store.connect(redis_url, "t", block_s=1, name="test")
    yield store
    await store.close()


async def test_admits_of_one_moment_go_in_one_call_and_keep_the_limit_exact(
    store: Store,
) -> None:
    """Sixty requests at once on a limit of 25: one call (or a few) carries
    them, exactly 25 are charged and queued, and each refused one is told
    when the window has room again."""
    store.admits.every_s = 60.0  # (nothing goes twice within the test)
    gateway = GatewayQueue(store, "gw")
    window = store.keys.quota_prefix + ":k"
    before = await evalsha_calls(store)
    results = await asyncio.gather(
        *(gateway.admit([Counter(window, 1, 25, 60)], "free", env(i)) for i in range(60))
    )
    calls = await evalsha_calls(store) - before
    assert calls <= 2, calls  # (all in the call sent once they are queued; at most two)
    admitted = [r for r in results if r.admitted]
    assert len(admitted) == 25
    assert all(r.queued for r in admitted)
    assert [r.counts[0] for r in admitted] == list(range(1, 26))  # each as if alone, in order
    refused = [r for r in results if not r.admitted]
    assert len(refused) == 35
    assert all(0 < r.ttls_ms[0] <= 66_000 for r in refused)
    assert await store.redis.zcard(store.keys.fair_queue("free")) == 25


async def test_the_first_admit_after_a_quiet_spell_is_not_held(store: Store) -> None:
    """Gathering holds admits only under load: a lone request goes at once
    (with admits held for a minute, it would wait that long)."""
    store.admits.every_s = 60.0
    gateway = GatewayQueue(store, "gw")
    started = time.monotonic()
    admitted = await asyncio.wait_for(gateway.admit([], "free", env(1)), timeout=10)
    assert admitted.queued
    assert time.monotonic() - started < 10


async def test_a_request_that_fails_fails_alone(store: Store) -> None:
    """A request whose arguments admit.lua cannot read fails with Redis's
    error; the requests gathered with it, before and after, are admitted."""
    store.admits.every_s = 60.0
    gateway = GatewayQueue(store, "gw")
    window = store.keys.quota_prefix + ":k"

    async def unreadable() -> object:
        return await store.admits.admit([window], [1, b"", "not a number", 10, 11, 60])

    before = await evalsha_calls(store)
    first, second, bad, last = await asyncio.gather(
        gateway.admit([Counter(window, 1, 10, 60)], "free", env(1)),
        gateway.admit([Counter(window, 1, 10, 60)], "free", env(2)),
        unreadable(),
        gateway.admit([Counter(window, 1, 10, 60)], "free", env(3)),
        return_exceptions=True,
    )
    assert await evalsha_calls(store) - before == 1  # (one call)
    assert isinstance(bad, ResponseError)
    assert [first.counts, second.counts, last.counts] == [[1], [2], [3]]
    assert await store.redis.zcard(store.keys.fair_queue("free")) == 3


async def test_admits_waiting_when_the_client_closes_fail_rather_than_hang(
    redis_url: str,
) -> None:
    store = Store.connect(redis_url, "t", block_s=1, name="test")
    admits = Admits(store.pipelined, store.scripts.admit, every_s=60.0)
    assert (await admits.admit([], [0, b""]))[0] == 1  # (charges nothing, queues nothing)
    held = admits.admit([], [0, b""])  # (not before a minute after the first)
    await admits.close()
    with pytest.raises(RedisConnectionError):
        await asyncio.wait_for(held, timeout=10)
    await store.close()


async def test_calls_on_the_wire_when_the_client_closes_fail_rather_than_hang(
    redis_url: str,
) -> None:
    """Closing at once after a call was written (its flusher has not yet
    run, so it never reaches its own clean-up) fails the call."""
    store = Store.connect(redis_url, "t", block_s=1, name="test")
    await store.redis.ping()
    pipelined = store.pipelined
    assert await pipelined.transaction([("PING",)], ()) == [b"PONG"]  # (its link is open)
    written = pipelined.transaction([("PING",)], ())  # written now, read by the flusher
    await pipelined.close()
    with pytest.raises(RedisConnectionError):
        await asyncio.wait_for(written, timeout=10)
    await store.close()


async def test_a_burst_goes_in_calls_of_at_most_most_back_to_back(store: Store) -> None:
    """A burst bigger than one call's worth is not held for ``every_s``
    between its calls, and each request is charged in its turn."""
    store.admits.every_s = 60.0  # (a wait between calls would time the test out)
    gateway = GatewayQueue(store, "gw")
    window = store.keys.quota_prefix + ":k"
    before = await evalsha_calls(store)
    burst = 3 * MOST  # (a last call of fewer would wait its turn)
    results = await asyncio.wait_for(
        asyncio.gather(
            *(gateway.admit([Counter(window, 1, 10_000, 60)], "free", env(i)) for i in range(burst))
        ),
        timeout=30,
    )
    assert [r.counts[0] for r in results] == list(range(1, burst + 1))
    assert await evalsha_calls(store) - before == 3


async def test_a_call_where_redis_is_out_of_memory_is_refused_whole(store: Store) -> None:
    """Redis checks for memory only until a script's first write, and an
    admit's first write may be one it does not check (a planted window is
    deleted): each request of a gathered call is refused all the same, and
    nothing is queued."""
    gateway = GatewayQueue(store, "gw")
    planted = store.keys.quota_prefix + ":planted"
    await store.redis.set(planted, "x")  # (admit.lua deletes it: no memory check)
    await store.redis.config_set("maxmemory-policy", "noeviction")
    await store.redis.config_set("maxmemory", 1)
    try:
        results = await asyncio.gather(
            gateway.admit([Counter(planted, 1, 10, 60)], "free", env(1)),
            gateway.admit([Counter(store.keys.quota_prefix + ":k", 1, 10, 60)], "free", env(2)),
            return_exceptions=True,
        )
    finally:
        await store.redis.config_set("maxmemory", 0)
    assert all(out_of_memory(r) for r in results), results
    assert await store.redis.zcard(store.keys.fair_queue("free")) == 0


async def test_long_inputs_are_gathered_a_quarter_megabyte_a_call(store: Store) -> None:
    """Inputs kept beside the queue (up to 64 KB each) cap a call by its
    bytes, so no call of them holds Redis for long; each is admitted."""
    store.admits.every_s = 0.5  # (the last call, not a whole call's worth, waits its turn)
    gateway = GatewayQueue(store, "gw")
    long = "x" * 60_000
    before = await evalsha_calls(store)
    results = await asyncio.wait_for(
        asyncio.gather(
            *(
                gateway.admit([], "free", env(i), beside=Beside(f"t:in:{i}", long, 60_000))
                for i in range(12)  # 720 KB: calls of 4, 4 and 4
            )
        ),
        timeout=30,
    )
    assert all(r.queued for r in results)
    assert await evalsha_calls(store) - before == 3
    assert MOST_BYTES // 60_000 == 4


async def test_an_admit_after_close_fails_at_once(redis_url: str) -> None:
    store = Store.connect(redis_url, "t", block_s=1, name="test")
    await store.close()
    with pytest.raises(RedisConnectionError):
        await asyncio.wait_for(store.admits.admit([], [0, b""]), timeout=10)


async def test_a_call_on_a_replica_is_refused_whole_and_drops_its_connection(
    redis_server: RedisServer,
) -> None:
    """A primary demoted under a gateway (a failover) refuses the call
    whole with READONLY, and the held connection goes, so the next call
    connects afresh (through Sentinel, to the new primary)."""
    replica = RedisServer(args=("--replicaof", "127.0.0.1", str(redis_server.port))).start()
    store = Store.connect(replica.url, "t", block_s=1, name="test")
    try:
        store.admits.every_s = 60.0
        gateway = GatewayQueue(store, "gw")
        window = store.keys.quota_prefix + ":k"
        results = await asyncio.gather(
            *(gateway.admit([Counter(window, 1, 10, 60)], "free", env(i)) for i in range(3)),
            return_exceptions=True,
        )
        assert all(isinstance(r, ReadOnlyError) for r in results), results
        assert store.pipelined._link is None
    finally:
        await store.close()
        replica.close()


async def test_a_gathered_call_leaves_redis_as_one_call_a_request_would(redis_url: str) -> None:
    """admit.lua reads each window and fair state once a call and writes it
    once as the call ends: the same requests, sent one call each or all in
    one call, get the same replies and leave the same windows, fair states
    and fair queues (keys of several weights and tiers, a limit reached, a
    key's share reached, and an unreadable request in the middle)."""
    weights = {"a": 1.0, "b": 2.0, "c": 0.5}
    envelopes = [env(i) for i in range(24)]

    def requests(store: Store) -> list[tuple[list[Counter], str, bytes, Place]]:
        out = []
        for i in range(24):
            key = "abc"[i % 3] if i < 12 else "aab"[i % 3]
            tier = "free" if i % 4 else "paid"
            counters = [
                Counter(f"{store.keys.quota_prefix}:{key}:requests", 1, 2 if key == "c" else 7, 60),
                Counter(f"{store.keys.quota_prefix}:{key}:chars", 10 + i, 10_000, 60),
            ]
            allowance = 0.0 if key == "c" else 5.0  # (c: no share check, a limit of 2)
            out.append(
                (counters, tier, envelopes[i], Place(key, 10 + i, weights[key], allowance, 1.5))
            )
        return out

    async def run(store: Store, gathered: bool) -> list[object]:
        gateway = GatewayQueue(store, "gw")

        async def admit(counters: list[Counter], tier: str, e: bytes, place: Place) -> object:
            return await gateway.admit(counters, tier, e, place=place)

        async def unreadable() -> object:
            return await store.admits.admit(
                [store.keys.quota_prefix + ":a:requests"], [1, b"", "x"]
            )

        calls: list[object] = [admit(*r) for r in requests(store)]
        calls.insert(9, unreadable())
        if gathered:
            store.admits.every_s = 60.0
            before = await evalsha_calls(store)
            results = await asyncio.gather(*calls, return_exceptions=True)
            assert await evalsha_calls(store) - before == 1
            return [str(r) if isinstance(r, Exception) else r for r in results]
        results = []
        for call in calls:
            try:
                results.append(await call)
            except ResponseError as exc:
                results.append(str(exc))
        return results

    async def left(store: Store) -> dict[str, object]:
        held: dict[str, object] = {}
        for key in ("a", "b", "c"):
            for kind in ("requests", "chars"):
                name = f"{store.keys.quota_prefix}:{key}:{kind}"
                window = await store.redis.hgetall(name)
                held[name.removeprefix(store.keys.quota_prefix)] = (
                    window.get(b"s"),
                    sum(int(v) for f, v in window.items() if f not in (b"s", b"l")),
                    await store.redis.pttl(name) > 0,
                )
        for tier in ("free", "paid"):
            held["state:" + tier] = await store.redis.hgetall(store.keys.fair_state(tier))
            held["queue:" + tier] = await store.redis.zrange(
                store.keys.fair_queue(tier), 0, -1, withscores=True
            )
        return held

    one_by_one = Store.connect(redis_url, "one", block_s=1, name="test")
    together = Store.connect(redis_url, "all", block_s=1, name="test")
    try:
        alone = await run(one_by_one, gathered=False)
        gathered = await run(together, gathered=True)
        # (the ms until a window has room is read off the clock: the runs
        # are a moment apart, and may fall on either side of the moment
        # a window's bucket (6 s of its 60) ends, which moves it by 6 s)
        assert [
            r._replace(ttls_ms=[], now_ms=0) if isinstance(r, Admitted) else r for r in gathered
        ] == [r._replace(ttls_ms=[], now_ms=0) if isinstance(r, Admitted) else r for r in alone]
        for was, now in zip(alone, gathered, strict=True):
            if isinstance(was, Admitted) and isinstance(now, Admitted):
                apart = [abs(a - b) for a, b in zip(was.ttls_ms, now.ttls_ms, strict=True)]
                assert all(min(d, abs(d - 6_000)) < 2_000 for d in apart), apart
        replies = [r for r in alone if isinstance(r, Admitted)]
        assert len(replies) == 24
        assert len(alone) == 25
        assert any(r.over_share for r in replies)
        assert any(not r.admitted and not r.over_share for r in replies)  # (over a limit)
        assert sum(r.queued for r in replies) >= 8
        assert await left(together) == await left(one_by_one)
    finally:
        await one_by_one.close()
        await together.close()
