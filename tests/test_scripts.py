"""The Lua scripts as the code a reader meets: each file one concern, short,
with a header that says what it does; and each script's Python binding
sends what the script reads and reads what it replies, on a real Redis."""

import re
from importlib import resources
from pathlib import Path

import pytest
from infergate.base import clock
from infergate.base.keys import Keys
from infergate.base.queue import forming, scripts
from infergate.base.queue.forming import Rule
from infergate.base.queue.gateway import Counter, GatewayQueue
from infergate.base.queue.store import Store
from infergate.base.tiers import TIERS

LUA = Path(str(resources.files("infergate.base.queue").joinpath("lua")))
MOST_LINES = 150


def test_every_lua_file_is_one_short_concern_with_a_header() -> None:
    files = sorted(LUA.glob("*.lua"))
    assert len(files) > 10
    for path in files:
        lines = path.read_text("utf-8").splitlines()
        assert len(lines) <= MOST_LINES, f"{path.name}: {len(lines)} lines"
        # "-- name: what it does", then a few lines of why
        assert re.match(rf"-- {path.stem}: \w", lines[0]), f"{path.name}: {lines[0]!r}"
        header = next(i for i, line in enumerate(lines) if not line.startswith("--"))
        assert 1 <= header <= 25, f"{path.name}: a header of {header} lines"


def test_every_script_loads_with_its_libraries(redis_url: str) -> None:
    """Each entry compiles with the libraries put before it (a library it
    needs and is not given fails it when run: the tests below run each)."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        given = {lib for libs in scripts.LIBRARIES.values() for lib in libs}
        entries = {p.stem for p in LUA.glob("*.lua")} - given
        for name in entries:
            client.script_load(scripts.source(name))
    finally:
        client.close()
    assert {"admit", "take_dispatch", "take_worker", "take_join", "take_withdrawn"} <= entries


@pytest.fixture
async def store(redis_url: str):
    store = Store.connect(redis_url, "arity", block_s=1, name="test")
    await store.redis.flushdb()
    yield store
    await store.close()


async def test_each_take_binding_is_answered_in_full_by_its_entry(store: Store) -> None:
    """Each take entry, called through its binding, runs past its checks
    (the worker alive, the credit held, the rule published) and replies
    with every field TakeResult names."""
    keys, now = store.keys, clock.now_ms()
    rule = Rule(4, 0, 0, min_slots=(0,) * len(TIERS))
    await store.redis.set(keys.heartbeat("worker", "w"), b"{}")
    await store.redis.set(keys.batch_rule, forming.encode_rule(rule))
    await store.redis.rpush(keys.credits("d"), "w")
    await store.redis.rpush(keys.processing("w"), b"ran")
    await store.redis.set(keys.withdrawn("w"), b"1")
    calls = [
        forming.dispatch_take(keys, "d", "w", "b", now, rule, envelopes=True),
        forming.worker_take(keys, "w", now, b"ran", "step", ack=False),
        forming.credit_take(keys, "take_join", "w", now, mark_ms=1000, room=4),
        forming.credit_take(keys, "take_withdrawn", "w", now),
    ]
    for call in calls:
        script = getattr(store.scripts, call.entry)
        raw = await script(keys=call.keys, args=call.args)
        assert len(raw) == len(forming.TAKE_REPLY), call.entry
        forming.take_result(raw)  # (and it reads as one)


async def test_the_admit_binding_reads_every_field_of_its_reply(store: Store) -> None:
    gateway = GatewayQueue(store, "gw")
    counters = [Counter(gateway.counter_key(f"c{i}"), 1, 10, 60) for i in range(3)]
    admitted = await gateway.admit(counters, "paid", b"{}")
    assert (admitted.admitted, admitted.queued) == (True, True)
    assert admitted.counts == [1, 1, 1]
    assert len(admitted.ttls_ms) == 3
    assert admitted.refused_by == -1


def test_keys_names_the_take_keys_in_the_order_take_pop_reads_them() -> None:
    """take_pop.lua's new_take reads six keys every take has, then the
    entry's own, then six per tier: the binding writes them so."""
    keys = Keys("ns")
    call = forming.credit_take(keys, "take_withdrawn", "w", 0)
    every = [keys.stats, keys.doorbell, keys.cancelled, keys.last_dispatch, keys.ready]
    assert call.keys[:5] == every
    assert call.keys[6:9] == [keys.batch_rule, keys.handoff("w"), keys.withdrawn("w")]
    assert call.keys[9:] == [
        *keys.queues,
        *keys.job_queues,
        *keys.fair_queues,
        *keys.fair_states,
        *keys.job_fair_queues,
        *keys.job_fair_states,
    ]
