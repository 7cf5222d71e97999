"""Long inputs wait beside the queue (``base/queue/inputs.py``): stored with
the admit that queues their envelope (and deleted by it if refused), fetched
by the worker that runs them, deleted with the answer; one that is gone
fails only its own request. Real Redis, the real scripts, a real worker."""

import asyncio
from collections.abc import Awaitable
from typing import Any

import msgspec
import pytest
from infergate.base import clock, wire
from infergate.base.errors import INPUT_NOT_STORED, input_not_stored, out_of_memory
from infergate.base.queue import dead_letters
from infergate.base.queue.dispatcher import DispatcherQueue
from infergate.base.queue.forming import Rule
from infergate.base.queue.gateway import Counter, GatewayQueue, Place
from infergate.base.queue.inputs import BESIDE_MIN_CHARS, GRACE_MS
from infergate.base.queue.store import Store
from infergate.gateway.quota import Quota
from infergate.gpu.backends.simulated import SimulatedBackend, sim_output
from infergate.gpu.worker import Worker, WorkerSettings
from infergate.policies import parse_policy
from redis.exceptions import ResponseError

from tests.helpers import as_yaml, command_calls, evalsha_calls, policy, queued

LONG = BESIDE_MIN_CHARS
NOT_STORED = INPUT_NOT_STORED


def _envelope(i: int, text: str, deadline_in_ms: int = 9_000) -> wire.Envelope:
    now = clock.now_ms()
    return wire.Envelope(f"r{i}", "gw", "paid", "k", text, now, now + deadline_in_ms)


async def _gone(store: Store, key: str, within_s: float = 10.0) -> bool:
    """``key`` is gone, or goes within ``within_s``."""
    deadline = asyncio.get_running_loop().time() + within_s
    while await store.redis.exists(key):
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


async def _admit(queue: GatewayQueue, env: wire.Envelope, limit: int = 100) -> bool:
    data, beside = queue.stored(env)
    counter = Counter(queue.counter_key("c"), 1, limit, 60)
    return (await queue.admit([counter], env.tier, data, beside=beside)).admitted


async def test_a_long_input_waits_beside_its_envelope_only_once_admitted(redis_url: str) -> None:
    store = Store.connect(redis_url, "t", name="test")
    queue = GatewayQueue(store, "gw")
    keys = store.keys
    try:
        text = "€" * LONG
        assert await _admit(queue, _envelope(1, text, deadline_in_ms=9_000))
        (raw,) = await store.redis.zrange(keys.fair_queue("paid"), -1, -1)
        waiting = wire.decode_envelope(raw)
        # The envelope carries the key, not the input.
        assert (waiting.input, waiting.input_key) == (None, keys.input("gw", "r1"))
        assert waiting.input_chars == LONG
        assert (await store.redis.get(keys.input("gw", "r1"))).decode() == text
        ttl_ms = await store.redis.pttl(keys.input("gw", "r1"))
        assert 9_000 < ttl_ms <= 9_000 + GRACE_MS
        # One character shorter: in the envelope, as always.
        assert await _admit(queue, _envelope(2, "x" * (LONG - 1)))
        (raw,) = await store.redis.zrange(keys.fair_queue("paid"), -1, -1)
        short = wire.decode_envelope(raw)
        assert (short.input, short.input_key) == ("x" * (LONG - 1), None)
        assert not await store.redis.exists(keys.input("gw", "r2"))
        # Refused by its quota: nothing queued, nothing stored.
        assert not await _admit(queue, _envelope(3, text), limit=2)
        assert not await store.redis.exists(keys.input("gw", "r3"))
        assert await queued(store, "paid") == 2
    finally:
        await store.close()


async def test_a_long_input_refused_by_its_keys_share_is_not_left_behind(redis_url: str) -> None:
    store = Store.connect(redis_url, "t", name="test")
    queue = GatewayQueue(store, "gw")
    place = Place("k", 1, 1.0, 1.0)  # (one of the tier's requests may wait: the key's share)
    try:
        results = []
        for i in (1, 2):
            data, beside = queue.stored(_envelope(i, "y" * LONG))
            results.append(await queue.admit([], "paid", data, beside=beside, place=place))
        assert [(r.admitted, r.over_share) for r in results] == [(True, False), (False, True)]
        assert await store.redis.exists(store.keys.input("gw", "r1"))
        assert not await store.redis.exists(store.keys.input("gw", "r2"))
    finally:
        await store.close()


async def test_a_long_input_handed_straight_to_an_idle_worker_waits_beside_too(
    redis_url: str,
) -> None:
    """The admit that hands a lone request straight to an idle worker (its
    keys and arguments after the input's) stores the input as well."""
    store = Store.connect(redis_url, "t", name="test")
    queue, keys = GatewayQueue(store, "gw"), store.keys
    try:
        await DispatcherQueue(store, "d1").publish_rule(Rule(100, 0, -1, min_slots=(0, 0, 0)))
        await store.redis.set(keys.heartbeat("worker", "w-1"), b"{}")
        await store.redis.lpush(keys.ready, "w-1")
        text = "s" * LONG
        data, beside = queue.stored(_envelope(1, text))
        counter = Counter(queue.counter_key("c"), 1, 100, 60)
        admitted = await queue.admit([counter], "paid", data, straight=True, beside=beside)
        assert (admitted.admitted, admitted.handed) == (True, True)
        batch, unreadable = wire.decode_batch(await store.redis.lindex(keys.handoff("w-1"), 0))
        assert unreadable == 0
        assert [(e.id, e.input, e.input_key) for e in batch.envelopes] == [
            ("r1", None, keys.input("gw", "r1"))
        ]
        assert (await store.redis.get(keys.input("gw", "r1"))).decode() == text
        assert await store.redis.llen(keys.ready) == 0
    finally:
        await store.close()


async def _batch_of(store: Store, envelopes: list[bytes]) -> bytes:
    """``envelopes`` (queued as given) formed into one batch for worker w-1, pulled."""
    keys = store.keys
    await store.redis.set(keys.heartbeat("worker", "w-1"), b"{}")
    await store.redis.lpush(keys.queue("paid"), *envelopes)
    await store.redis.rpush(keys.credits("d1"), "w-1")
    taken = await DispatcherQueue(store, "d1").take(
        "w-1", "b1", clock.now_ms(), Rule(100, 0, -1, min_slots=(0, 0, 0))
    )
    assert taken.size == len(envelopes)
    data = await store.redis.lmove(keys.handoff("w-1"), keys.processing("w-1"), "RIGHT", "LEFT")
    assert data is not None
    return data


async def test_a_worker_runs_long_inputs_and_deletes_them_with_the_answer(
    redis_url: str,
) -> None:
    worker = Worker(WorkerSettings("w-1", redis_url), SimulatedBackend(latency_ms=0))
    store, keys = worker.store, worker.store.keys
    gateway = GatewayQueue(store, "gw")
    texts = [f"{i}" + "é" * LONG for i in range(3)] + ["short"]
    try:
        queued = []
        for i, text in enumerate(texts):
            data, beside = gateway.stored(_envelope(i, text))
            assert (beside is None) == (text == "short")
            if beside is not None:
                await store.redis.set(beside.key, beside.input, px=beside.ttl_ms)
            queued.append(data)
        # The batch is made of the envelopes alone.
        batch = await _batch_of(store, queued)
        assert len(batch) < 1_000
        answer = (await worker.handle(batch)).answer()
        results = sorted(answer.replies["gw"].results, key=lambda r: r.id)
        assert [r.output for r in results] == [sim_output(t) for t in texts]
        assert sorted(answer.inputs_done) == [keys.input("gw", f"r{i}") for i in range(3)]
        await worker.queue.answer_batch(
            answer.replies, clock.now_ms(), batch, inputs_done=answer.inputs_done
        )
        assert await store.redis.exists(*(keys.input("gw", f"r{i}") for i in range(3))) == 0
        assert await store.redis.llen(keys.processing("w-1")) == 0
    finally:
        await store.close()


async def test_an_input_that_is_gone_fails_its_own_request_not_the_batch(
    redis_url: str,
) -> None:
    """Missing (evicted, lost), not text, or under a key that is not an
    input's (planted: never read, never deleted): SERVICE_OVERLOADED (503,
    to be retried) for that request; the others in the batch run."""
    worker = Worker(WorkerSettings("w-1", redis_url), SimulatedBackend(latency_ms=0))
    store, keys = worker.store, worker.store.keys
    text = "y" * LONG
    try:
        await store.redis.set(keys.input("gw", "real"), text)
        await store.redis.set(keys.input("gw", "binary"), b"\xff\xfe" * LONG)
        await store.redis.set(keys.policy, b"not an input")
        cases = {
            "real": keys.input("gw", "real"),
            "missing": keys.input("gw", "missing"),
            "binary": keys.input("gw", "binary"),
            "planted": keys.policy,
        }
        now = clock.now_ms()
        queued = [
            wire.encode(
                wire.Envelope(rid, "gw", "paid", "k", None, now, now + 9_000, input_key=key)
            )
            for rid, key in cases.items()
        ]
        queued.append(wire.encode(_envelope(9, "short")))
        batch = await _batch_of(store, queued)
        answer = (await worker.handle(batch)).answer()
        by_id = {r.id: r for r in answer.replies["gw"].results}
        assert by_id["real"].output == sim_output(text)
        assert by_id["r9"].output == sim_output("short")
        for rid in ("missing", "binary", "planted"):
            error = by_id[rid].error
            assert error is not None, rid
            assert error.code == "SERVICE_OVERLOADED", rid
        assert len(by_id) == 5
        await worker.queue.answer_batch(
            answer.replies, clock.now_ms(), batch, inputs_done=answer.inputs_done
        )
        assert not await store.redis.exists(keys.input("gw", "real"))
        assert await store.redis.get(keys.policy) == b"not an input"
        # A batch whose every input is gone is answered all the same.
        queued = [
            wire.encode(
                wire.Envelope(
                    "gone", "gw", "paid", "k", None, now, now + 9_000, input_key=cases["missing"]
                )
            )
        ]
        answer = (await worker.handle(await _batch_of(store, queued))).answer()
        (result,) = answer.replies["gw"].results
        assert result.id == "gone"
        assert result.error is not None
    finally:
        await store.close()


class _EnvelopeBefore(msgspec.Struct):
    """The envelope as workers before ``input_key`` read it."""

    id: str
    gateway: str
    tier: str
    key_id: str
    input: str
    enqueued_ms: int
    deadline_ms: int


async def test_code_from_before_drops_an_envelope_whose_input_waits_beside(
    redis_url: str,
) -> None:
    """A gateway rolled out before the workers: its long input's envelope is
    unreadable to their decoder and to their take_*.lua's check (a string
    input), so it is dropped (504 at its deadline), never run as an empty
    input (a wrong 200, and a wrong answer kept in the cache). A short
    input's envelope is the same bytes as before."""
    store = Store.connect(redis_url, "t", name="test")
    try:
        long, _ = GatewayQueue(store, "gw").stored(_envelope(1, "x" * LONG))
        short, _ = GatewayQueue(store, "gw").stored(_envelope(2, "hello"))
        try:
            msgspec.json.decode(long, type=_EnvelopeBefore)
            read_before = True
        except msgspec.ValidationError:
            read_before = False
        assert not read_before
        assert msgspec.json.decode(short, type=_EnvelopeBefore).input == "hello"
        assert b"input_key" not in short
        checks = "local e = cjson.decode(ARGV[1]) return type(e.input) == 'string' and 1 or 0"
        assert await store.redis.eval(checks, 0, long) == 0
        assert await store.redis.eval(checks, 0, short) == 1
    finally:
        await store.close()


async def test_an_input_goes_with_its_batch_or_when_take_drops_its_request(
    redis_url: str,
) -> None:
    """Every input of a batch goes with its answer, those of requests that
    expired in it too (the batch leaves processing: none runs again), even
    when none of it is left to run; the input of a request ``take`` drops
    (cancelled, expired) goes as it is dropped."""
    worker = Worker(WorkerSettings("w-1", redis_url), SimulatedBackend(latency_ms=0))
    store, keys = worker.store, worker.store.keys
    gateway = GatewayQueue(store, "gw")
    now = clock.now_ms()
    try:
        for deadlines in ((now + 9_000, now - 1), (now - 1, now - 2)):
            queued = []
            for i, deadline_ms in enumerate(deadlines):
                env = wire.Envelope(f"r{i}", "gw", "paid", "k", "w" * LONG, now - 10, deadline_ms)
                data, beside = gateway.stored(env)
                assert beside is not None
                await store.redis.set(beside.key, beside.input)
                queued.append(data)
            batch = wire.encode_batch("b1", "d1", now, queued)
            await store.redis.lpush(keys.processing("w-1"), batch)
            # The operators' view of the batch still says how long each input is.
            assert dead_letters.describe(batch, 0).input_chars == [LONG, LONG]
            answer = (await worker.handle(batch)).answer()
            live = [r.id for r in answer.replies.get("gw", wire.Reply([])).results]
            assert live == (["r0"] if deadlines[0] > now else [])
            await worker.queue.answer_batch(
                answer.replies, clock.now_ms(), batch, inputs_done=answer.inputs_done
            )
            assert await store.redis.exists(keys.input("gw", "r0"), keys.input("gw", "r1")) == 0

        cancelled, expired = _envelope(7, "c" * LONG), _envelope(8, "e" * LONG, deadline_in_ms=1)
        assert await _admit(gateway, cancelled)
        assert await _admit(gateway, expired)
        await gateway.cancel(cancelled.id, cancelled.deadline_ms)
        assert await store.redis.exists(keys.input("gw", "r7"), keys.input("gw", "r8")) == 2
        await store.redis.set(keys.heartbeat("worker", "w-1"), b"{}")
        await store.redis.rpush(keys.credits("d1"), "w-1")
        taken = await DispatcherQueue(store, "d1").take(
            "w-1", "b2", expired.deadline_ms + 1, Rule(100, 0, -1, min_slots=(0, 0, 0))
        )
        assert (taken.size, taken.cancelled, taken.expired) == (0, 1, 1)
        assert await store.redis.exists(keys.input("gw", "r7"), keys.input("gw", "r8")) == 0
    finally:
        await store.close()


async def test_near_maxmemory_an_input_is_kept_exactly_when_its_request_is_queued(
    redis_url: str,
) -> None:
    """Redis judges memory command by command, so near ``maxmemory`` a long
    input's SET and the admit after it can go different ways (the tests
    below make each case happen). Whatever the margin, an input is kept if
    and only if its request is queued, a refused request is refused for
    want of memory (503), and only a queued one is charged."""
    store = Store.connect(redis_url, "t", name="test")
    queue = GatewayQueue(store, "gw")
    keys = store.keys
    text = "x" * 30_000
    await store.redis.config_set("maxmemory-policy", "noeviction")
    admitted_count = 0
    outcomes = set()
    try:
        for i, margin in enumerate(range(-2_000, 64_000, 500)):
            used = int((await store.redis.info("memory"))["used_memory"])
            await store.redis.config_set("maxmemory", max(1, used + margin))
            refusal: BaseException | None = None
            try:
                admitted = await _admit(queue, _envelope(i, text), limit=10_000)
            except ResponseError as exc:
                refusal = exc
                admitted = False
            finally:
                await store.redis.config_set("maxmemory", 0)
            assert admitted or out_of_memory(refusal) or NOT_STORED in str(refusal), refusal
            name = keys.input("gw", f"r{i}")
            kept = (
                bool(await store.redis.exists(name)) if admitted else not await _gone(store, name)
            )
            assert kept == admitted, (margin, admitted, kept)
            admitted_count += admitted
            outcomes.add(admitted)
        assert outcomes == {True, False}
        # Charged only when queued: the next request's count says how many were.
        data, beside = queue.stored(_envelope(999, text))
        counter = Counter(queue.counter_key("c"), 1, 10_000, 60)
        after = await queue.admit([counter], "paid", data, beside=beside)
        assert after.counts[0] == await queued(store, "paid") == admitted_count + 1
    finally:
        await store.close()


async def test_a_call_refused_whole_after_its_inputs_were_written_leaves_none(
    redis_url: str,
) -> None:
    """The inputs' SETs taken, then the call refused for want of memory (here
    Redis is made full between them, in the same write): each request fails
    as out of memory and no input is left, not even that of a request
    whose caller gave up while the call was on its way."""
    store = Store.connect(redis_url, "t", name="test")
    queue = GatewayQueue(store, "gw")
    pipelined = store.admits.pipelined
    real = pipelined.call
    callers: list[asyncio.Task[bool]] = []

    def full_after_the_inputs(
        script: Any, keys: list[str], args: list[Any], before: Any = ()
    ) -> Any:
        callers[1].cancel()  # (its caller gives up as the call goes)
        return real(script, keys, args, (*before, ("CONFIG", "SET", "maxmemory", "1")))

    await store.redis.config_set("maxmemory-policy", "noeviction")
    pipelined.call = full_after_the_inputs  # type: ignore[method-assign]
    try:
        callers += [asyncio.ensure_future(_admit(queue, _envelope(i, "w" * LONG))) for i in (1, 2)]
        results = await asyncio.gather(*callers, return_exceptions=True)
    finally:
        pipelined.call = real  # type: ignore[method-assign]
        await store.redis.config_set("maxmemory", 0)
    try:
        assert out_of_memory(results[0]), results
        assert isinstance(results[1], asyncio.CancelledError)
        assert await command_calls(store, "set") >= 2  # (both inputs were written)
        for i in (1, 2):  # (deleted once the callers are answered)
            assert await _gone(store, store.keys.input("gw", f"r{i}"))
        assert await queued(store, "paid") == 0
    finally:
        await store.close()


async def test_an_admit_whose_caller_gave_up_before_it_went_sends_nothing(
    redis_url: str,
) -> None:
    store = Store.connect(redis_url, "t", name="test")
    store.admits.every_s = 0.2  # (the second waits its turn: time to give up)
    queue = GatewayQueue(store, "gw")
    try:
        assert await _admit(queue, _envelope(1, "v" * LONG))
        gave_up = asyncio.ensure_future(_admit(queue, _envelope(2, "v" * LONG)))
        await asyncio.sleep(0)  # (its task runs up to its admit, which waits to be sent)
        assert len(store.admits._waiting) == 1
        gave_up.cancel()
        assert await _admit(queue, _envelope(3, "v" * LONG))
        assert not await store.redis.exists(store.keys.input("gw", "r2"))
        assert await queued(store, "paid") == 2
    finally:
        await store.close()


async def test_a_request_whose_input_was_not_stored_fails_charging_nothing(
    redis_url: str,
) -> None:
    """The other way round: the input's SET refused (Redis full), then
    memory freed before the admit. The admit finds no input and fails that
    request (503), charging nothing, where it would have queued a request
    that could only fail later."""
    store = Store.connect(redis_url, "t", name="test")
    queue = GatewayQueue(store, "gw")
    real = store.admits.admit
    store.admits.admit = lambda keys, args, before=None: real(keys, args)  # type: ignore[method-assign]
    try:
        with pytest.raises(ResponseError, match=NOT_STORED) as caught:
            await _admit(queue, _envelope(1, "y" * LONG))
        assert await queued(store, "paid") == 0
        # (its own 503 at the gateway, not "Redis full" nor "unreachable")
        assert input_not_stored(caught.value)
        assert not out_of_memory(caught.value)
        store.admits.admit = real  # type: ignore[method-assign]
        data, beside = queue.stored(_envelope(2, "y" * LONG))
        counter = Counter(queue.counter_key("c"), 1, 100, 60)
        admitted = await queue.admit([counter], "paid", data, beside=beside)
        assert (admitted.admitted, admitted.counts) == (True, [1])
    finally:
        await store.close()


class _FreeKey:
    """The policy's free key under ``limits`` (its tier's), charged through
    a gateway's quotas, each request with a long input queued on its tier."""

    def __init__(self, store: Store, **limits: Any) -> None:
        self.quota = Quota(GatewayQueue(store, "gw"))
        pol = parse_policy(as_yaml(policy(tiers={"free": limits})))
        self.key = next(k for k in pol.document.keys if k.id == "fre")
        self.tier = pol.tiers["free"]

    async def charge(self, i: int, chars: int = LONG) -> bool:
        data, beside = self.quota.queue.stored(_envelope(i, "z" * chars))
        result = await self.quota.charge(self.key, self.tier, chars, "free", data, beside)
        return result.allowed


async def test_a_key_refused_lately_holds_its_inputs_back_until_it_has_room(
    redis_url: str,
) -> None:
    """After a refusal by its limit, a key's long inputs are not written
    while it is expected to be refused again (until the limit has room), so
    a refused request's input costs Redis nothing; one that finds room
    after all (here: a refund) is sent again with its input, charged once."""
    store = Store.connect(redis_url, "t", name="test")
    free = _FreeKey(store, rate_limits=["3/minute"])

    def stored(i: int) -> Awaitable[int]:
        return store.redis.exists(store.keys.input("gw", f"r{i}"))

    try:
        assert [await free.charge(i) for i in range(1, 5)] == [True, True, True, False]
        assert [await stored(i) for i in range(1, 5)] == [1, 1, 1, 0]  # (r4's deleted)
        before = await command_calls(store, "set")
        assert not await free.charge(5)
        assert await command_calls(store, "set") == before  # held back: never written
        await free.quota.refund(free.key, free.tier, LONG)
        assert await free.charge(6)  # room after all: sent again with its input
        assert await stored(6)
        assert await queued(store, "free") == 4
        assert not await free.charge(7)  # (the limit is exact: 3 charged)
    finally:
        await store.close()


async def test_a_refusal_by_a_cost_limit_holds_nothing_back(redis_url: str) -> None:
    """A cost limit refuses a request by its size, not the next one: a
    smaller request of the same key goes with its input at once."""
    store = Store.connect(redis_url, "t", name="test")
    free = _FreeKey(store, rate_limits=["100/minute"], cost_limit="3500/hour")
    try:
        assert [await free.charge(1, 2_000), await free.charge(2, 2_000)] == [True, False]
        before = await evalsha_calls(store)
        assert await free.charge(3, LONG)
        assert await evalsha_calls(store) - before == 1  # (not held back: one call)
        assert await store.redis.exists(store.keys.input("gw", "r3"))
        assert await queued(store, "free") == 2
    finally:
        await store.close()
