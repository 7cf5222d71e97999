"""An idle loop's credit while the backend it shares with other shards
runs their batches (``gpu/gate.py``): it joins the call about to start
(``take_join.lua``: a batch of what waits on its shard, whoever held the
credit, whatever the pacing), or is withdrawn until the call ends and then
given back ('withdrawn'), on real Redis; and the gate's side of it."""

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from infergate.base import clock, wire
from infergate.base.queue.dispatcher import DispatcherQueue
from infergate.base.queue.forming import Rule, new_batch_id
from infergate.base.queue.gateway import GatewayQueue
from infergate.base.queue.store import Store
from infergate.base.queue.worker import BlockingTake, WorkerQueue
from infergate.gpu.gate import Gate

from tests.helpers import paid_envelope, queued, wait_for

PACED = Rule(100, 10_000, -1, min_slots=(0, 0, 0))  # (a dispatcher or a worker would wait)
UNPACED = Rule(100, 0, -1, min_slots=(0, 0, 0))


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[Store]:
    store = Store.connect(redis_url, "t", block_s=1, name="test")
    await store.redis.set(store.keys.heartbeat("worker", "w1"), "{}")
    yield store
    await store.close()


@pytest.fixture
def take(store: Store, redis_url: str) -> Any:
    blocking = WorkerQueue(store, "w1").blocking_take(redis_url, timeout_s=2.0)
    yield blocking
    blocking.close()


async def _queue(store: Store, count: int) -> None:
    for i in range(count):
        await GatewayQueue(store, "gw").enqueue("paid", paid_envelope(i))


async def _handed(store: Store) -> list[str]:
    data = await store.redis.lindex(store.keys.handoff("w1"), 0)
    assert data is not None
    batch, unreadable = wire.decode_batch(data)
    assert not unreadable
    return [e.id for e in batch.envelopes]


async def test_a_credit_a_dispatcher_holds_joins_the_call_at_once_whatever_the_pacing(
    store: Store, take: BlockingTake
) -> None:
    dispatcher = DispatcherQueue(store, "d1")
    await dispatcher.publish_rule(PACED)
    await store.redis.set(store.keys.last_dispatch, clock.now_ms())
    await store.redis.sadd(store.keys.members("dispatcher"), "d1")
    await store.redis.lpush(store.keys.credits("d1"), "w1")  # (waiting for its pacing slot)
    await _queue(store, 3)

    joined = await asyncio.to_thread(take.join_call, clock.now_ms(), 5_000, 100)

    assert (joined.size, joined.credit_lost) == (3, False)
    assert sorted(await _handed(store)) == ["r0", "r1", "r2"]
    assert await store.redis.llen(store.keys.credits("d1")) == 0
    assert not await store.redis.exists(store.keys.withdrawn("w1"))
    # the dispatcher finds it gone, as after the reaper took it back, and forms nothing
    taken = await dispatcher.take("w1", new_batch_id(), clock.now_ms(), PACED)
    assert (taken.credit_lost, taken.size) == (True, 0)
    assert await store.redis.llen(store.keys.handoff("w1")) == 1


async def test_with_nothing_waiting_the_credit_is_withdrawn_then_given_back_once(
    store: Store, take: BlockingTake
) -> None:
    await DispatcherQueue(store, "d1").publish_rule(UNPACED)
    await store.redis.lpush(store.keys.ready, "w1")

    joined = await asyncio.to_thread(take.join_call, clock.now_ms(), 5_000, 100)

    assert (joined.size, joined.credit_lost) == (0, False)
    assert await store.redis.llen(store.keys.ready) == 0
    assert 0 < await store.redis.pttl(store.keys.withdrawn("w1")) <= 5_000
    # nothing offers it again meanwhile (an idle worker's check finds it out)
    assert not await WorkerQueue(store, "w1").ensure_credit()
    assert await store.redis.llen(store.keys.ready) == 0
    # what came while the call ran is its batch as the call ends
    await _queue(store, 2)
    back = await asyncio.to_thread(take.give_back_credit, clock.now_ms())
    assert back.size == 2
    assert sorted(await _handed(store)) == ["r0", "r1"]
    assert not await store.redis.exists(store.keys.withdrawn("w1"))
    # once: a second give back finds nothing withdrawn, and no credit goes out
    again = await asyncio.to_thread(take.give_back_credit, clock.now_ms())
    assert again.size == 0
    assert await store.redis.llen(store.keys.ready) == 0


async def test_a_join_takes_no_more_than_the_room_left_in_the_call(
    store: Store, take: BlockingTake
) -> None:
    await DispatcherQueue(store, "d1").publish_rule(UNPACED)
    await store.redis.lpush(store.keys.ready, "w1")
    await _queue(store, 3)
    joined = await asyncio.to_thread(take.join_call, clock.now_ms(), 5_000, 2)
    assert joined.size == 2
    assert sorted(await _handed(store)) == ["r0", "r1"]
    # a call already full: nothing is taken, and the credit waits for its end
    await store.redis.delete(store.keys.handoff("w1"))
    await store.redis.lpush(store.keys.ready, "w1")
    joined = await asyncio.to_thread(take.join_call, clock.now_ms(), 5_000, 0)
    assert (joined.size, joined.credit_lost) == (0, False)
    assert await store.redis.exists(store.keys.withdrawn("w1"))
    assert await queued(store, "paid") == 1


async def test_a_credit_given_back_with_nothing_to_take_goes_back_on_ready(
    store: Store, take: BlockingTake
) -> None:
    await DispatcherQueue(store, "d1").publish_rule(UNPACED)
    # (the last batch still in processing, its answer going out, its take
    # having offered the credit: it comes back all the same)
    await store.redis.lpush(store.keys.processing("w1"), b"the last batch")
    await store.redis.lpush(store.keys.ready, "w1")
    await asyncio.to_thread(take.join_call, clock.now_ms(), 5_000, 100)
    back = await asyncio.to_thread(take.give_back_credit, clock.now_ms())
    assert back.size == 0
    assert await store.redis.lrange(store.keys.ready, 0, -1) == [b"w1"]
    assert await store.redis.llen(store.keys.handoff("w1")) == 0


async def test_a_credit_spent_or_out_of_reach_is_left_as_it_is(
    store: Store, take: BlockingTake
) -> None:
    await DispatcherQueue(store, "d1").publish_rule(UNPACED)
    await _queue(store, 2)
    await store.redis.lpush(store.keys.handoff("w1"), b"a batch handed off")  # (spent)
    joined = await asyncio.to_thread(take.join_call, clock.now_ms(), 5_000, 100)
    assert (joined.credit_lost, joined.size) == (True, 0)
    assert not await store.redis.exists(store.keys.withdrawn("w1"))
    assert await store.redis.llen(store.keys.ready) == 0
    assert await store.redis.llen(store.keys.handoff("w1")) == 1
    # a planted member of the dispatchers (no list of credits) is passed over
    await store.redis.sadd(store.keys.members("dispatcher"), "planted")
    await store.redis.set(store.keys.credits("planted"), "not a list")
    joined = await asyncio.to_thread(take.join_call, clock.now_ms(), 5_000, 100)
    assert (joined.credit_lost, joined.size) == (True, 0)


async def test_a_batch_pulled_from_the_shared_list_takes_the_withdrawn_credit_with_it(
    store: Store, take: BlockingTake
) -> None:
    await DispatcherQueue(store, "d1").publish_rule(UNPACED)
    await store.redis.lpush(store.keys.ready, "w1")
    await asyncio.to_thread(take.join_call, clock.now_ms(), 5_000, 100)  # (withdrawn)
    await store.redis.lpush(store.keys.batches, b"a batch the reaper retried")
    pulled = await WorkerQueue(store, "w1").pull_batch(0.05)
    assert pulled == b"a batch the reaper retried"
    assert not await store.redis.exists(store.keys.withdrawn("w1"))
    # the call ends: nothing is given back (the worker offers its credit
    # once that batch has run), so no second credit goes out
    await _queue(store, 1)
    back = await asyncio.to_thread(take.give_back_credit, clock.now_ms())
    assert back.size == 0
    assert await store.redis.llen(store.keys.ready) == 0
    assert await store.redis.llen(store.keys.handoff("w1")) == 0


async def test_a_planted_hand_off_key_or_a_worker_gone_forms_nothing(
    store: Store, take: BlockingTake
) -> None:
    await DispatcherQueue(store, "d1").publish_rule(UNPACED)
    await _queue(store, 2)
    # a hand-off key of another type: the withdrawn credit goes back, no error
    await store.redis.set(store.keys.withdrawn("w1"), "1")
    await store.redis.set(store.keys.handoff("w1"), "planted")
    back = await asyncio.to_thread(take.give_back_credit, clock.now_ms())
    assert back.size == 0
    assert await store.redis.lrange(store.keys.ready, 0, -1) == [b"w1"]
    assert not await store.redis.exists(store.keys.withdrawn("w1"))
    # a worker that has left (no heartbeat): its credit forms no batch
    await store.redis.delete(store.keys.handoff("w1"), store.keys.heartbeat("worker", "w1"))
    joined = await asyncio.to_thread(take.join_call, clock.now_ms(), 5_000, 100)
    assert (joined.credit_lost, joined.size) == (True, 0)
    assert await store.redis.llen(store.keys.handoff("w1")) == 0
    await store.redis.set(store.keys.withdrawn("w1"), "1")
    back = await asyncio.to_thread(take.give_back_credit, clock.now_ms())
    assert back.size == 0
    assert await store.redis.llen(store.keys.handoff("w1")) == 0
    assert await queued(store, "paid") == 2


# -- the gate's side -------------------------------------------------------------------


class _Backend:
    name = fingerprint = "upper"

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def infer(self, inputs: list[str]) -> list[str]:
        self.calls.append(list(inputs))
        time.sleep(0.02)  # (the call's time)
        return [s.upper() for s in inputs]


def test_an_idle_shard_joins_the_call_and_a_withdrawn_credit_comes_back_after_it() -> None:
    backend = _Backend()
    gate = Gate(backend, max_inputs=10, hold_s=2.0)  # type: ignore[arg-type]
    steps: list[str] = []
    out: dict[str, list[str]] = {}

    def join_with_a_batch(room: int) -> tuple[int, bool]:
        steps.append(f"join 1 (room {room})")
        # (its loop's call arrives with the batch formed)
        threading.Thread(target=lambda: out.update(b=gate.call(1, 2, ["b"], None))).start()
        return 1, False

    def join_withdrawn(room: int) -> tuple[int, bool]:
        steps.append("join 2")
        return 0, True

    def give_back() -> bool:
        steps.append("give back 2")
        return False  # (nothing came: its loop is not waited for)

    gate.attach(0, lambda room: (0, False), lambda: False)
    gate.attach(1, join_with_a_batch, lambda: False)
    gate.attach(2, join_withdrawn, give_back)

    assert gate.call(0, 0, ["a"], None) == ["A"]
    wait_for(lambda: "b" in out and "give back 2" in steps, 5, "the joined call and the give back")

    assert backend.calls == [["a", "b"]]  # one call, the joined batch in it (best tier first)
    assert out["b"] == ["B"]
    assert sorted(steps) == ["give back 2", "join 1 (room 9)", "join 2"]
    assert steps[-1] == "give back 2"
    # shard 2 formed nothing as it got its credit back, shard 1 came back:
    # the next call waits for no one (the hold is 2 s)
    started = time.monotonic()
    gate.pass_turn(1)
    assert gate.call(0, 0, ["c"], None) == ["C"]
    assert time.monotonic() - started < 1.0


def test_a_join_that_fails_is_not_asked_again_for_a_while_and_the_calls_run() -> None:
    backend = _Backend()
    gate = Gate(backend, max_inputs=10, hold_s=0.0)  # type: ignore[arg-type]
    asked: list[int] = []

    def fails(room: int) -> tuple[int, bool]:
        asked.append(room)
        raise ConnectionError("its shard is away")

    gate.attach(1, fails, lambda: False)
    assert gate.call(0, 0, ["a"], None) == ["A"]
    assert gate.call(0, 0, ["b"], None) == ["B"]
    assert backend.calls == [["a"], ["b"]]
    assert asked == [9]  # (its shard paused after the failure: FAILED_PAUSE_S)


def test_a_slow_join_does_not_hold_the_call_back_and_its_credit_still_comes_back() -> None:
    backend = _Backend()
    gate = Gate(backend, max_inputs=10, hold_s=0.0)  # type: ignore[arg-type]
    given_back = threading.Event()

    def slow(room: int) -> tuple[int, bool]:
        time.sleep(0.6)  # (a Redis that answers late)
        return 0, True  # (withdrawn)

    gate.attach(1, slow, lambda: given_back.set() or False)
    started = time.monotonic()
    assert gate.call(0, 0, ["a"], None) == ["A"]
    assert time.monotonic() - started < 0.5  # (JOIN_WAIT_S, then the call)
    # the call ended before the join did: the credit comes back at once
    assert given_back.wait(5)


def test_no_join_piles_up_behind_one_that_waits_on_a_slow_shard() -> None:
    backend = _Backend()
    gate = Gate(backend, max_inputs=10, hold_s=0.0)  # type: ignore[arg-type]
    release, asked = threading.Event(), []

    def stuck(room: int) -> tuple[int, bool]:
        asked.append(room)
        assert release.wait(10)
        return 0, False

    gate.attach(1, stuck, lambda: False)
    for text in ("a", "b", "c"):
        assert gate.call(0, 0, [text], None) == [text.upper()]
    release.set()
    wait_for(lambda: gate._last_step is not None and gate._last_step.done(), 5, "the step")
    assert asked == [9]  # (the later calls started without asking again)


def test_a_joined_call_its_server_did_not_answer_is_not_run_again_part_by_part() -> None:
    """No input is at fault when the server does not answer: every part
    gets that error from the one call, not a wait on the server each."""
    from infergate.gpu.backend import UpstreamError

    class Down(_Backend):
        def infer(self, inputs: list[str]) -> list[str]:
            self.calls.append(list(inputs))
            raise UpstreamError("the model's server did not answer")

    backend = Down()
    gate = Gate(backend, max_inputs=10, hold_s=2.0)  # type: ignore[arg-type]
    errors: dict[str, BaseException] = {}

    def call(name: str, shard: int, text: str) -> None:
        try:
            gate.call(shard, shard, [text], None)
        except UpstreamError as exc:
            errors[name] = exc

    def join_with_a_batch(room: int) -> tuple[int, bool]:
        threading.Thread(target=call, args=("b", 1, "b")).start()
        return 1, False

    gate.attach(0, lambda room: (0, False), lambda: False)
    gate.attach(1, join_with_a_batch, lambda: False)
    call("a", 0, "a")
    wait_for(lambda: "b" in errors, 5, "the joined call's error")
    assert backend.calls == [["a", "b"]]
    assert sorted(errors) == ["a", "b"]
