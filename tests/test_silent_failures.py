"""No failure stays silent: what used to end a background loop, drop a batch
or give up quietly, now logged, survived, answered and visible in readiness.
Real processes on a real Redis, corrupted the way a bad deploy, a bug or a
hostile writer with Redis access would."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import redis
from infergate.base import clock, wire
from infergate.base.queue import dead_letters
from infergate.base.queue.dispatcher import DispatcherQueue
from infergate.base.queue.forming import Rule
from infergate.base.queue.gateway import GatewayQueue
from infergate.base.queue.store import Store
from infergate.base.queue.worker import WorkerQueue
from infergate.gpu.answers import Answer, Finished
from infergate.gpu.backends.simulated import SimulatedBackend, sim_output
from infergate.gpu.worker import Worker, WorkerSettings
from infergate.redis_server import RedisServer

from tests.helpers import KEYS, SECRETS, Cluster, http, policy_yaml, wait_for


def log_events(path: Path) -> list[dict]:
    events = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events


async def _steady_load(url: str, n: int, rate: float) -> list[tuple[int, str, dict]]:
    hdrs = {"Authorization": "Bearer " + SECRETS["paid"]}
    async with aiohttp.ClientSession() as session:

        async def one(i: int) -> tuple[int, str, dict]:
            text = f"steady-{i}"
            async with session.post(url + "/v1/inference", json={"input": text}, headers=hdrs) as r:
                return r.status, text, await r.json()

        tasks = []
        start = time.monotonic()
        for i in range(n):
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
            tasks.append(asyncio.create_task(one(i)))
        return await asyncio.gather(*tasks)


def test_corrupt_heartbeats_and_envelopes_under_load_leave_the_service_whole(
    tmp_path: Path, own_redis: RedisServer
) -> None:
    client = redis.Redis.from_url(own_redis.url)
    c = Cluster(tmp_path, own_redis.url, policy_yaml(), workers=2, latency_ms=50)
    try:

        def corrupt() -> None:
            # A "worker" whose heartbeat is not a heartbeat (and never expires).
            client.set(KEYS.heartbeat("worker", "w-corrupt"), b"\x00garbage")
            client.sadd(KEYS.members("worker"), "w-corrupt")
            # An envelope that passes take's checks but is not an Envelope (no
            # tier, key or enqueue time): it lands in a batch beside real ones.
            half = {"id": "evil", "gateway": "nobody", "input": "x", "deadline_ms": 9e15}
            client.lpush(KEYS.queue("paid"), json.dumps(half))
            # And plain junk, which take drops.
            client.lpush(KEYS.queue("paid"), b"\xff not json")

        async def scenario() -> list[tuple[int, str, dict]]:
            load = asyncio.create_task(_steady_load(c.urls[0], 150, 50.0))
            await asyncio.sleep(1.0)  # pacing: corrupt Redis a second into the load
            await asyncio.to_thread(corrupt)
            return await load

        results = asyncio.run(scenario())
        # Every real request was answered with its own output: the batch that
        # carried the bad envelope ran its good ones.
        assert [s for s, _, _ in results] == [200] * 150
        assert all(body["output"] == sim_output(text) for _, text, body in results)
        # The corrupt heartbeat blinded no one, and the reaper dropped it.
        wait_for(
            lambda: not client.sismember(KEYS.members("worker"), "w-corrupt"),
            5,
            "the reaper to drop the corrupt worker",
        )
        assert not client.exists(KEYS.heartbeat("worker", "w-corrupt"))
        status = c.status()
        assert status["workers_alive"] == 2
        assert status["counters"]["malformed_dropped"] == 1
        assert http("GET", c.urls[0] + "/readyz")[0] == 200
        # ...and said so, once each, without a traceback for data it skips.
        worker_events = [e for w in c.workers for e in log_events(w.log_path)]
        assert [e["event"] for e in worker_events].count("batch.envelopes_unreadable") == 1
        gateway_events = [e["event"] for e in log_events(c.gateways[0].log_path)]
        # Once at most (the reaper may drop it before this gateway's next refresh).
        assert gateway_events.count("fleet.heartbeat_unreadable") <= 1
        assert "loop.failed" not in gateway_events
    finally:
        client.close()
        c.stop()


def test_a_loop_that_keeps_failing_says_so_in_logs_and_readiness(
    tmp_path: Path, own_redis: RedisServer
) -> None:
    client = redis.Redis.from_url(own_redis.url)
    c = Cluster(tmp_path, own_redis.url, policy_yaml(), workers=1, latency_ms=20)
    url = c.urls[0]
    try:
        assert c.infer("paid", "before")[0] == 200
        # The fleet's read is refused (an ACL that denies SMEMBERS): every
        # fleet refresh now fails with a Redis error that is not an outage.
        # (A planted members set no longer does: the read drops it.)
        client.execute_command("ACL", "SETUSER", "default", "-smembers")
        wait_for(lambda: http("GET", url + "/readyz")[0] == 503, 5, "readiness to say not ready")
        status, _, body = c.infer("paid", "during")
        assert status == 503
        assert body["error"]["code"] == "SERVICE_OVERLOADED"
        failed = wait_for(
            lambda: [
                e
                for e in log_events(c.gateways[0].log_path)
                if e["event"] == "loop.failed" and e.get("loop") == "fleet-view"
            ],
            5,
            "the failure to be logged",
        )
        assert "ResponseError" in failed[0]["exception"]  # with its stack
        # Repaired: the loops never stopped, so the service comes back by itself.
        client.execute_command("ACL", "SETUSER", "default", "+smembers")
        wait_for(lambda: http("GET", url + "/readyz")[0] == 200, 10, "readiness to come back")
        assert c.infer("paid", "after")[0] == 200
    finally:
        client.close()
        c.stop()


class _Buggy:
    """A backend with a bug: it raises something that is not a BackendError."""

    name = "buggy"
    lacks: frozenset[str] = frozenset()
    upstream = None

    def infer(self, inputs: list[str]) -> list[str]:
        raise KeyError("a bug, not a model failure")


async def test_a_batch_that_fails_outside_the_backend_is_answered(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    worker = Worker(WorkerSettings("w-buggy", redis_url), _Buggy())
    now = clock.now_ms()
    envs = [
        wire.encode(wire.Envelope(f"r{i}", f"gw{i % 2}", "paid", "k", f"in{i}", now, now + 9_000))
        for i in range(4)
    ]
    try:
        replies = (await worker.handle(wire.encode_batch("b1", "d1", now, envs))).answer().replies
    finally:
        await worker.store.close()
    assert set(replies) == {"gw0", "gw1"}
    results = [r for reply in replies.values() for r in reply.results]
    assert sorted(r.id for r in results) == ["r0", "r1", "r2", "r3"]
    assert all(r.error is not None and r.error.code == "INFERENCE_FAILED" for r in results)
    # The bug's traceback is in the log, for whoever has to fix it.
    assert "KeyError: 'a bug, not a model failure'" in capsys.readouterr().out


# Envelopes that Redis's cjson reads (so take_*.lua batches them) but JSON
# does not: each would have made its whole batch unreadable to the worker
# (or, the last, raised UnicodeDecodeError out of it, ending its loop).
_CJSON_ONLY = [
    b'"x":NaN',
    b'"x":[Infinity,-Infinity]',
    b'"x":0x10',
    b'"x":01',
    b'"x":+1',
    b'"x":1.',
    b'"x":"a\tb\nc"',  # a raw tab and newline inside a string
    b'"id":"\x95"',  # not UTF-8 (cjson keeps the last id, msgspec reads the first)
]


async def _redis_now_ms(store: Store) -> int:
    """Redis's clock, which take_*.lua judges deadlines by (this process's
    clock is aligned to it only while a component of its own beats)."""
    seconds, micros = await store.redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def test_an_envelope_only_cjson_reads_fails_alone_not_its_batch(redis_url: str) -> None:
    """Planted in a queue between real requests, each such envelope passes
    take_*.lua's check and lands in their batch: the worker runs the real ones
    and drops it (it cannot be answered: it is not an envelope)."""
    worker = Worker(WorkerSettings("w-1", redis_url), SimulatedBackend(latency_ms=0))
    store = worker.store
    queue = store.keys.queue("paid")
    now = await _redis_now_ms(store)
    try:
        await store.redis.set(store.keys.heartbeat("worker", "w-1"), b"{}")
        for n, extra in enumerate(_CJSON_ONLY):
            real = [
                wire.Envelope(f"r{n}-{i}", "gw", "paid", "k", f"in {i}", now, now + 9_000)
                for i in range(2)
            ]
            planted = b"{" + extra + b',"id":"evil","gateway":"gw","input":"x","deadline_ms":9e15}'
            await store.redis.lpush(queue, wire.encode(real[0]), planted, wire.encode(real[1]))
            await store.redis.rpush(store.keys.credits("d1"), "w-1")
            taken = await DispatcherQueue(store, "d1").take(
                "w-1", f"b{n}", now, Rule(100, 0, -1, min_slots=(0, 0, 0))
            )
            assert taken.size == 3, extra  # the planted one is in the batch
            data = await worker.queue.pull_batch(1)
            assert data is not None
            replies = (await worker.handle(data)).answer().replies
            results = replies["gw"].results
            assert sorted(r.id for r in results) == [f"r{n}-0", f"r{n}-1"], extra
            assert all(
                r.output == sim_output(f"in {i}")
                for i, r in enumerate(sorted(results, key=lambda r: r.id))
            )
            await store.redis.delete(store.keys.processing("w-1"))
        assert await store.redis.llen(store.keys.dead_letter) == 0
    finally:
        await store.close()


def test_a_batch_with_such_an_envelope_is_retried_whole() -> None:
    """The reaper's retry keeps every envelope's bytes (the planted one too,
    dropped again by the next worker), and strings holding brackets, commas
    and escaped quotes are not split."""
    now = clock.now_ms()
    text = 'in, [a] {b} "c" \\'
    real = [
        wire.encode(wire.Envelope(f"r{i}", "gw", "paid", "k", text, now, now + 9_000))
        for i in range(2)
    ]
    for extra in _CJSON_ONLY:
        planted = b"{" + extra + b',"id":"evil","gateway":"gw","input":"x","deadline_ms":9e15}'
        data = wire.encode_batch("b1", "d1", now, [real[0], planted, real[1]])
        retried = wire.retried_batch(data)
        assert retried == data.replace(b'"attempt":0,', b'"attempt":1,'), extra
        batch, unreadable = wire.decode_batch(retried)
        assert ([e.id for e in batch.envelopes], unreadable, batch.attempt) == (["r0", "r1"], 1, 1)
        assert all(e.input == text for e in batch.envelopes)


async def test_an_envelope_with_a_nul_byte_never_reaches_a_batch(redis_url: str) -> None:
    """cjson stops reading at a NUL byte: what follows one (here, a forged
    envelope, and a bracket that would end the batch's list) is dropped
    with it by take_*.lua, and counted."""
    store = Store.connect(redis_url, "t", block_s=1, name="test")
    now = await _redis_now_ms(store)
    planted = b'{"id":"evil","gateway":"gw","input":"x","deadline_ms":9e15}\x00'
    forged = wire.Envelope("victim", "gw", "paid", "k", "FORGED", now, now + 9_000)
    try:
        await store.redis.set(store.keys.heartbeat("worker", "w-1"), b"{}")
        real = wire.encode(wire.Envelope("r0", "gw", "paid", "k", "in", now, now + 9_000))
        for tail in (b"," + wire.encode(forged), b'],"x":[0', b"]"):
            await store.redis.lpush(store.keys.queue("paid"), real, planted + tail)
            await store.redis.rpush(store.keys.credits("d1"), "w-1")
            rule = Rule(100, 0, -1, min_slots=(0, 0, 0))
            taken = await DispatcherQueue(store, "d1").take("w-1", "b", now, rule)
            assert (taken.size, taken.malformed) == (1, 1), tail
            batch, unreadable = wire.decode_batch(await store.redis.rpop(store.keys.handoff("w-1")))
            assert ([e.id for e in batch.envelopes], unreadable) == (["r0"], 0)
    finally:
        await store.close()


def test_a_batch_frames_each_envelope_by_its_length() -> None:
    """No byte of an envelope is read to find where it ends: brackets,
    commas, quotes and NaN inside one (planted) leave the others whole,
    however long the batch."""
    now = clock.now_ms()
    text = "€" * 16_384 + '"\\],{'  # 49 KB as JSON
    real = [wire.Envelope(f"r{i}", "gw", "paid", "k", text, now, now + 9_000) for i in range(45)]
    for planted in (
        b'{"id":"evil","gateway":"gw","input":"x","deadline_ms":NaN}',
        b'],"attempt":9}\n5\n{"id":"forged"}',
        b'"' + b'\\"' * 100_000,
    ):
        data = wire.encode_batch("b", "d", now, [*map(wire.encode, real), planted])
        batch, unreadable = wire.decode_batch(data)
        assert (len(batch.envelopes), unreadable, batch.attempt) == (45, 1, 0)
        assert all(e.input == text for e in batch.envelopes)


def test_a_broken_frame_is_an_unreadable_batch() -> None:
    good = wire.encode_batch("b", "d", 1, [b'{"id":"x"}'])
    assert b'"lengths":[10]}\n{"id":"x"}' in good
    for broken in (
        wire.BATCH_FRAME,  # no head
        wire.BATCH_FRAME + b'{"id":"b"}\n',  # a head without its fields
        good[:-1],  # cut short
        good + b"x",  # more than the lengths say
        good.replace(b'"lengths":[10]', b'"lengths":[-1,11]'),  # a length below zero
        good.replace(b'"lengths":[10]', b'"lengths":["10"]'),  # not a length
    ):
        with pytest.raises(msgspec.DecodeError):
            wire.decode_batch(broken)


def test_a_batch_from_before_the_frame_is_still_read() -> None:
    """Version 1 (one JSON document), from a process not yet upgraded: read,
    and retried in the same version."""
    now = clock.now_ms()
    envs = [
        wire.encode(wire.Envelope(f"r{i}", "gw", "paid", "k", "in", now, now + 9_000))
        for i in range(2)
    ]
    old = (
        b'{"id":"b","dispatcher":"d","formed_ms":1,"envelopes":['
        + b",".join(envs)
        + b'],"attempt":0}'
    )
    batch, unreadable = wire.decode_batch(old)
    assert ([e.id for e in batch.envelopes], unreadable) == (["r0", "r1"], 0)
    retried = wire.retried_batch(old)
    assert retried == old.replace(b'"attempt":0}', b'"attempt":1}')
    assert wire.decode_batch(retried)[0].attempt == 1


async def test_a_member_or_credit_that_is_not_utf8_blinds_no_one(redis_url: str) -> None:
    """A name in a members set, or a credit on ready, that is not UTF-8 (no
    process has one) raised out of every read of the fleet: the reaper's,
    the gateways' fleet view and status, a worker's credit check. Now it is
    dropped where it is read, and the rest is read as ever."""
    store = Store.connect(redis_url, "t", block_s=1, name="test")
    keys = store.keys
    try:
        await store.redis.set(keys.heartbeat("worker", "w-1"), b"{}")
        await store.redis.sadd(keys.members("worker"), b"w-1", b"\xff")
        await store.redis.sadd(keys.members("dispatcher"), b"\xfe")
        beats, _ = await store.heartbeats(["worker", "dispatcher"])
        assert beats == {"worker": {"w-1": b"{}"}, "dispatcher": {}}
        assert await store.redis.smembers(keys.members("worker")) == {b"w-1"}
        assert await store.redis.smembers(keys.members("dispatcher")) == set()
        assert [
            h.id for h in (await store.fleet_status()).alive["worker"]
        ] == []  # ("{}": not a heartbeat)
        # A worker checking its credit against the dispatchers' held ones.
        await store.redis.sadd(keys.members("dispatcher"), b"\xfe")
        assert await WorkerQueue(store, "w-2").ensure_credit()
        # A dispatcher waiting for a credit: the planted one goes, the next is held.
        await store.redis.rpush(keys.ready, b"w-1", b"\xfd")  # the planted one oldest
        dispatcher = DispatcherQueue(store, "d1")
        assert await dispatcher.wait_credit(1) is None
        assert await dispatcher.wait_credit(1) == "w-1"
        assert await store.redis.lrange(keys.credits("d1"), 0, -1) == [b"w-1"]
    finally:
        await store.close()


async def test_a_job_record_with_bytes_that_are_not_utf8_is_read(redis_url: str) -> None:
    """Its fields and values are replaced, not raised (out of the GET of the job)."""
    store = Store.connect(redis_url, "t", block_s=1, name="test")
    try:
        await store.redis.hset(
            store.keys.job("j1"), mapping={b"\xff": b"x", b"status": b"\xfequeued", b"key_id": b"k"}
        )
        record = await GatewayQueue(store, "gw").job("j1")
        assert record["key_id"] == "k"
        assert record["status"] == "\ufffdqueued"
        assert record["\ufffd"] == "x"
    finally:
        await store.close()


async def test_an_unreadable_batch_is_dead_lettered_not_dropped(redis_url: str) -> None:
    worker = Worker(WorkerSettings("w-1", redis_url), _Buggy())
    store = worker.store
    try:
        await store.redis.lpush(store.keys.batches, b"{not a batch")
        data = await worker.queue.pull_batch(1)
        assert data is not None
        assert (await worker.handle(data)).answer().replies == {}
        assert await store.redis.lrange(store.keys.dead_letter, 0, -1) == [b"{not a batch"]
        assert await store.redis.llen(store.keys.processing("w-1")) == 0
        total, (letter,) = await dead_letters.read(store, 10)
        assert (total, letter.error, letter.size_bytes) == (1, dead_letters.UNREADABLE, 12)
    finally:
        await store.close()


async def test_a_finished_batch_is_published_once_redis_returns_however_long_it_takes(
    own_redis: RedisServer,
) -> None:
    from infergate.gpu.backends.simulated import SimulatedBackend

    worker = Worker(WorkerSettings("w-pub", own_redis.url), SimulatedBackend(latency_ms=0))
    store = worker.store
    now = clock.now_ms()
    env = wire.Envelope("r1", "gw", "paid", "k", "in", now, now + 60_000)
    await store.redis.lpush(store.keys.processing("w-pub"), b"the batch")
    reply = wire.Reply([wire.Result("r1", "b", 1, "w-pub", 0, 1, output="out")])
    own_redis.kill()
    stop = asyncio.Event()

    async def finish() -> None:
        assert await worker.loop.take_next(b"the batch", stop) == (False, None)
        await worker.loop.answer(
            Finished(1, lambda: Answer({env.gateway: reply})), stop, b"the batch"
        )

    answering = asyncio.create_task(finish())
    # Redis stays away for a while: the worker keeps trying, it does not give up.
    await asyncio.sleep(3.0)  # pacing: the outage lasts this long
    assert not answering.done()
    own_redis.start()
    checker = Store.connect(own_redis.url, "infergate", name="checker")
    pubsub = checker.redis.pubsub()
    await pubsub.subscribe(checker.keys.reply_channel("gw"))
    try:
        await asyncio.wait_for(answering, 15)
        # The take ran against the restarted (empty) Redis, which had lost the
        # batch and the credit with it: it found its batch gone, and the
        # worker put its credit back at once.
        assert await checker.redis.lrange(checker.keys.ready, 0, -1) == [b"w-pub"]
    finally:
        await pubsub.aclose()
        await checker.close()
        await store.close()


async def test_a_worker_that_leaves_a_batch_unanswered_leaves_it_to_the_reaper(
    redis_url: str,
) -> None:
    from infergate.base.queue.recovery import RecoveryQueue
    from infergate.gpu.backends.simulated import SimulatedBackend

    worker = Worker(WorkerSettings("w-left", redis_url), SimulatedBackend(latency_ms=0))
    store = worker.store
    try:
        await worker.heartbeat.beat_once()
        await store.redis.lpush(store.keys.processing("w-left"), b"the batch")
        await worker._retire()
        dead = await RecoveryQueue(store, "reaper").expired(("worker",))
        assert "w-left" in dead["worker"]  # found by the reaper's next sweep
        # A worker that answered everything leaves no trace.
        await store.redis.delete(store.keys.processing("w-left"))
        await worker._retire()
        assert not await store.redis.sismember(store.keys.members("worker"), "w-left")
    finally:
        await store.close()


def test_a_process_runs_with_what_it_started_with_out_of_the_collector_s_way() -> None:
    """A full collection scans only what the process made since it started
    (``runtime.freeze_heap``): over the whole start-up heap it held a
    gateway's loop for tens of ms at a time."""
    code = (
        "import gc\n"
        "from infergate.base import runtime\n"
        "async def main(stop):\n"
        "    print(gc.get_freeze_count(), flush=True)\n"
        "    return 0\n"
        "raise SystemExit(runtime.run(main))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert int(done.stdout) > 10_000  # (the modules imported, at least)


def started_process(
    after_stop: str, *, before: str = "", run_args: str = "", **popen: Any
) -> "subprocess.Popen[str]":
    """A process whose ``runtime.run(main)`` prints 'started', waits for its
    stop, then runs ``after_stop`` (lines of main's body) and returns 0;
    ``before``: lines ahead of main. Returned once it has started (stdout
    a pipe, read as text)."""
    code = (
        "import asyncio\n"
        "from infergate.base import logs, runtime\n"
        f"{before}"
        "async def main(stop):\n"
        "    print('started', flush=True)\n"
        "    await stop.wait()\n"
        f"{after_stop}"
        "    return 0\n"
        f"raise SystemExit(runtime.run(main{run_args}))\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, **popen
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "started"
    return proc


def assert_drained(proc: "subprocess.Popen[str]") -> None:
    """``proc`` (``started_process``) drained, said so, and exited 0."""
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "drained"
    assert proc.wait(10) == 0


def ended(proc: "subprocess.Popen[str]") -> None:
    """``proc`` is gone, and its pipe closed (whatever the test found)."""
    proc.kill()
    if proc.stdout is not None:
        proc.stdout.close()


def test_a_shutdown_that_hangs_is_ended_and_says_where(tmp_path: Path) -> None:
    proc = started_process(
        "    await never_finishes_its_cleanup()\n",
        before=(
            "logs.configure('test', 'stuck')\n"
            "async def never_finishes_its_cleanup():\n"
            "    await asyncio.Event().wait()\n"
        ),
        run_args=", shutdown_grace_s=1.0",
        stderr=subprocess.PIPE,
        env={**os.environ, "INFERGATE_LOG_FORMAT": "json"},
    )
    assert proc.stdout is not None
    assert proc.stderr is not None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 4
    stderr = proc.stderr.read()
    proc.stdout.close()
    proc.stderr.close()
    stuck = [e for e in map(json.loads, stderr.splitlines()) if e.get("event")]
    (event,) = [e for e in stuck if e["event"] == "shutdown.stuck"]
    assert any(
        "never_finishes_its_cleanup" in frame
        for frames in event["tasks"].values()
        for frame in frames
    )


@pytest.mark.parametrize("ignored", [False, True], ids=["terminal", "nohup"])
def test_sighup_drains_unless_the_process_was_started_ignoring_it(ignored: bool) -> None:
    """A terminal that closes sends SIGHUP: the process drains as for
    SIGTERM (before, it died at once). One started under nohup (SIGHUP
    ignored) outlives its terminal, as it was asked to."""
    proc = started_process(
        "    print('drained', flush=True)\n",
        # (set both ways: the runner itself may run under nohup)
        preexec_fn=lambda: signal.signal(
            signal.SIGHUP, signal.SIG_IGN if ignored else signal.SIG_DFL
        ),
    )
    assert proc.stdout is not None
    try:
        proc.send_signal(signal.SIGHUP)
        if ignored:
            with pytest.raises(subprocess.TimeoutExpired):
                proc.wait(1)  # (bounded: it must still be running)
            proc.send_signal(signal.SIGTERM)
        assert_drained(proc)
    finally:
        ended(proc)


def test_a_process_whose_stderr_is_gone_still_drains() -> None:
    """Its terminal closed (or its log reader left): log lines are lost,
    the drain is not (before, the first line after it raised)."""
    proc = started_process(
        "    for _ in range(100):\n"
        "        log.info('draining', padding='x' * 1000)\n"
        "    print('drained', flush=True)\n",
        before="logs.configure('test', 'gone')\nlog = logs.get('test')\n",
        stderr=subprocess.PIPE,
        env={**os.environ, "INFERGATE_LOG_FORMAT": "json"},
    )
    assert proc.stdout is not None
    assert proc.stderr is not None
    try:
        proc.stderr.close()  # (its reader gone: a write is EPIPE)
        proc.send_signal(signal.SIGTERM)
        assert_drained(proc)
    finally:
        ended(proc)


def test_deeply_nested_json_from_redis_is_unreadable_not_a_crash() -> None:
    """msgspec raises RecursionError on deep nesting; every decoder of bytes
    from Redis turns it into the DecodeError its callers handle."""
    nested = b'{"role":"worker","x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for decode in (
        wire.decode_heartbeat,
        wire.decode_envelope,
        wire.decode_reply,
        wire.decode_scale_signal,
        wire.decode_result,
    ):
        with pytest.raises(msgspec.DecodeError):
            decode(nested)
    with pytest.raises(msgspec.DecodeError):
        wire.decode_batch(nested)


def test_a_string_from_redis_that_is_not_utf8_is_unreadable_not_a_crash() -> None:
    """msgspec raises UnicodeDecodeError for one it reads: the same
    DecodeError here, which every caller handles."""
    bad = b'"\xff"'
    for decode, data in (
        (wire.decode_heartbeat, b'{"role":' + bad + b',"id":"w","started_ms":1,"beat_ms":1}'),
        (wire.decode_envelope, b'{"id":' + bad + b',"gateway":"g","tier":"t","key_id":"k"}'),
        (wire.decode_result, b'{"id":' + bad + b',"batch_id":"b","batch_size":1}'),
        (wire.decode_reply, b'{"results":[{"id":' + bad + b',"batch_id":"b"}]}'),
        (wire.decode_batch, b'{"id":' + bad + b',"dispatcher":"d","formed_ms":1,"envelopes":[]}'),
        (wire.retried_batch, b'{"id":' + bad + b',"dispatcher":"d","formed_ms":1,"envelopes":[]}'),
        (
            wire.decode_batch,
            wire.BATCH_FRAME + b'{"id":' + bad + b',"dispatcher":"d","formed_ms":1}\n',
        ),
        (
            wire.retried_batch,
            wire.BATCH_FRAME + b'{"id":' + bad + b',"dispatcher":"d","formed_ms":1}\n',
        ),
    ):
        with pytest.raises(msgspec.DecodeError):
            decode(data)


async def test_a_worker_stopping_has_one_publish_grace_for_everything_it_still_sends(
    redis_url: str,
) -> None:
    """The grace counts from the first step that finds the worker stopping:
    a take and an answer after it share it, so the shutdown grace covers both."""
    from infergate.base.loops import retry_until_done
    from infergate.gpu.backends.simulated import SimulatedBackend

    settings = WorkerSettings("w-grace", redis_url, publish_grace_s=0.5)
    worker = Worker(settings, SimulatedBackend(latency_ms=0))
    stop = asyncio.Event()
    stop.set()

    async def redis_away() -> None:
        raise redis.exceptions.ConnectionError("Redis is away")

    async def give_up_after(what: str) -> float:
        started = asyncio.get_running_loop().time()
        done = await retry_until_done(what, redis_away, stop, grace_after_stop_s=worker.grace_left)
        assert not done
        return asyncio.get_running_loop().time() - started

    try:
        assert await give_up_after("batch.take") >= 0.5  # the whole grace
        # The answer after it finds the grace spent: it gives up at its first
        # failure, where a grace of its own would have kept it 0.5 s more.
        assert await give_up_after("batch.publish") < 0.25
    finally:
        await worker.store.close()


async def test_a_planted_cache_ttl_is_answered_not_kept(redis_url: str) -> None:
    """Redis refuses a TTL past its range, and the whole answer with it: a
    worker retried that answer forever, taking no more work. An envelope
    asking the cache to keep its answer longer than a policy can (a day)
    was planted: its answer goes out, and is not kept."""
    worker = Worker(WorkerSettings("w-1", redis_url), SimulatedBackend(latency_ms=0))
    now = clock.now_ms()
    envs = [
        wire.Envelope(
            "r0", "gw", "paid", "k", "in", now, now + 9_000, cache_key="a", cache_ttl_ms=ttl
        )
        for ttl in (2**63 - 1,)
    ] + [
        wire.Envelope(
            "r1", "gw", "paid", "k", "in1", now, now + 9_000, cache_key="b", cache_ttl_ms=60_000
        )
    ]
    try:
        data = wire.encode_batch("b1", "d1", now, [wire.encode(e) for e in envs])
        await worker.store.redis.lpush(worker.store.keys.processing("w-1"), data)
        answer = (await worker.handle(data)).answer()
        assert sorted(r.id for r in answer.replies["gw"].results) == ["r0", "r1"]
        assert [k.digest for k in answer.keep] == ["b"]
        # The answer's transaction goes through.
        await worker.queue.answer_batch(answer.replies, now, data, answer.keep)
        assert await worker.store.redis.llen(worker.store.keys.processing("w-1")) == 0
    finally:
        await worker.store.close()


async def test_a_key_planted_under_a_jobs_name_does_not_stop_every_take(redis_url: str) -> None:
    """A job's record is a hash: a take that found a string under its name
    failed (WRONGTYPE) for every batch after it. It is left alone now."""
    store = Store.connect(redis_url, "t", block_s=1, name="test")
    now = clock.now_ms()
    try:
        await store.redis.set(store.keys.heartbeat("worker", "w-1"), b"{}")
        await store.redis.set(store.keys.job("evil"), b"not a hash")
        planted = wire.Envelope("evil", "gw", "paid", "k", "x", now, now + 9_000, job=True)
        real = wire.Envelope("r0", "gw", "paid", "k", "in", now, now + 9_000)
        await store.redis.lpush(store.keys.queue("paid"), wire.encode(real))
        await store.redis.lpush(store.keys.job_queue("paid"), wire.encode(planted))
        await store.redis.rpush(store.keys.credits("d1"), "w-1")
        rule = Rule(100, 0, 0, min_slots=(0, 0, 0))
        taken = await DispatcherQueue(store, "d1").take("w-1", "b", now, rule)
        assert taken.size == 2
        assert await store.redis.get(store.keys.job("evil")) == b"not a hash"
    finally:
        await store.close()
