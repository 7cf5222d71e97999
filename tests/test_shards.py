"""One deployment over two Redis shards: each key's work on its own shard,
both shards carrying load, quotas exact across gateways, the priority
between tiers held across shards by the worker's gate, and a shard that
dies refusing only its own keys while the other's are served."""

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import redis
from infergate.base.queue import shards
from infergate.gpu.backend import BackendError
from infergate.gpu.backends.simulated import sim_output
from infergate.gpu.gate import Gate
from infergate.redis_server import RedisServer

from tests.helpers import (
    KEYS,
    Cluster,
    as_yaml,
    assert_redis_clean,
    auth,
    http,
    key_entry,
    policy,
    stats,
    wait_for,
)
from tests.sentinel import SentinelSet

ADMIN = auth("admin")

# -- the hash --------------------------------------------------------------------


def test_a_key_has_one_shard_spread_evenly_and_a_new_shard_moves_only_its_share() -> None:
    two = [shards.identity(f"redis://10.0.0.{i}:6379/0") for i in (1, 2)]
    three = [*two, shards.identity("redis://10.0.0.3:6379/0")]
    before = [shards.shard_of(f"key-{i}", two) for i in range(6000)]
    after = [shards.shard_of(f"key-{i}", three) for i in range(6000)]
    assert 2700 < before.count(0) < 3300
    moved = [(b, a) for b, a in zip(before, after, strict=True) if a != b]
    assert all(a == 2 for _, a in moved)  # (only to the new shard)
    assert 1700 < len(moved) < 2300
    # The db as redis-py reads it: the query's wins over the path's.
    assert shards.identity("redis://h/7?db=1") == shards.identity("redis://h:6379/01")
    # Reordered URLs, a password added: no key moves.
    reordered = [shards.identity(u) for u in ("redis://:pw@10.0.0.2:6379", "redis://10.0.0.1/0")]
    assert [shards.shard_of(f"key-{i}", reordered) for i in range(200)] == [
        1 - b for b in before[:200]
    ]
    # A shard named after '#' keeps its keys wherever it is reached.
    named = [shards.identity(u) for u in ("redis://10.0.0.1/0#east", "redis://10.0.0.2/0#west")]
    moved = [shards.identity(u) for u in ("redis://10.9.9.9:7000/3#east", "redis://h/0#west")]
    assert [shards.shard_of(f"key-{i}", named) for i in range(200)] == [
        shards.shard_of(f"key-{i}", moved) for i in range(200)
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no Redis URL"),
        ("redis://a:1/0 redis://a:1/0", "same server"),
        ("redis://a:1/0 http://:secret@b/0", "URL 2 of 2"),
        # Two Sentinel setups whose services share a name, unnamed: one identity.
        ("redis+sentinel://:secret@a:26379/mymaster redis+sentinel://b:26379/mymaster", "#name"),
        ("redis://a:1/0#x redis://b:1/0#x", "same shard name"),
        # Named apart, but one Redis (or one Sentinel service, through a sentinel both list).
        ("redis://a:1/0#x redis://A:1/0#y", "reach the same"),
        ("redis://a:1/0 redis://a:1/1", "whatever their dbs"),  # (one Lua thread, one pub/sub)
        ("redis+sentinel://s:1/m/0 redis+sentinel://s:1/m/1", "whatever their dbs"),
        ("redis+sentinel://s:1,t:1/m#x redis+sentinel://t:1/m/0#y", "reach the same"),
        ("redis://a:1/0#", "after '#'"),
        ("redis://:secret#x@a:1/0", "%23"),  # (an unescaped '#' in a password)
        (" ".join(f"redis://h{i}:1/0" for i in range(65)), "at most 64"),
    ],
)
def test_a_bad_list_of_urls_is_refused_without_quoting_it(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as caught:
        shards.urls(text)
    assert "secret" not in str(caught.value)


# -- the gate ---------------------------------------------------------------------


class _Backend:
    """Records each call; one at a time (it raises otherwise); ``poison`` fails a call."""

    name, fingerprint = "fake", "fake/1"

    def __init__(self, seconds: float = 0.3) -> None:
        self.seconds = seconds
        self.calls: list[list[str]] = []
        self.lock = threading.Lock()

    def infer(self, inputs: list[str]) -> list[str]:
        assert self.lock.acquire(blocking=False), "two calls at once"
        try:
            self.calls.append(list(inputs))
            time.sleep(self.seconds)
            if any("poison" in text for text in inputs):
                raise BackendError("poisoned")
            return [text.upper() for text in inputs]
        finally:
            self.lock.release()

    def infer_sampled(self, inputs: list[str], temperatures: list[float]) -> list[str]:
        return self.infer(inputs)

    def clip(self, text: str, max_tokens: int) -> tuple[str, int]:
        return text, 0


def _start(target: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=target)
    thread.start()
    return thread


def _call(gate: Gate, shard: int, rank: int, inputs: list[str], out: dict[str, Any]) -> None:
    try:
        out[inputs[0]] = gate.call(shard, rank, inputs, None)
    except BackendError as exc:
        out[inputs[0]] = exc


def _calls(gate: Gate, calls: list[tuple[int, int, list[str]]]) -> dict[str, Any]:
    """A first call runs; the others arrive while it does, then all end."""
    out: dict[str, Any] = {}
    first = _start(lambda: _call(gate, *calls[0], out))
    wait_for(lambda: gate.backend.calls, 2, "the first call")  # type: ignore[attr-defined]
    rest = [_start(lambda c=c: _call(gate, *c, out)) for c in calls[1:]]
    wait_for(lambda: len(gate._waiting) == len(rest), 2, "the other calls waiting")
    for thread in (first, *rest):
        thread.join(10)
    return out


def test_calls_of_several_shards_that_fit_run_as_one_backend_call() -> None:
    backend = _Backend()
    gate = Gate(backend, max_inputs=10, hold_s=0.0)
    out = _calls(gate, [(0, 1, ["a0"]), (1, 2, ["b1", "b2"]), (0, 0, ["a1", "a2", "a3"])])
    assert out == {"a0": ["A0"], "b1": ["B1", "B2"], "a1": ["A1", "A2", "A3"]}
    assert backend.calls[1] == ["a1", "a2", "a3", "b1", "b2"]  # (best tier first)
    assert gate.together == 1


def test_inputs_fill_each_backend_call_best_tier_first_and_a_batch_may_span_two() -> None:
    backend = _Backend()
    gate = Gate(backend, max_inputs=4, hold_s=0.0)
    free, ent = ["f1", "f2", "f3"], ["e1", "e2", "e3"]
    out = _calls(gate, [(0, 1, ["p"]), (1, 2, free), (0, 0, ent)])
    assert backend.calls[1:] == [["e1", "e2", "e3", "f1"], ["f2", "f3"]]
    assert out == {"p": ["P"], "f1": ["F1", "F2", "F3"], "e1": ["E1", "E2", "E3"]}


def test_a_call_run_together_that_fails_is_run_again_part_by_part() -> None:
    backend = _Backend()
    gate = Gate(backend, max_inputs=10, hold_s=0.0)
    out = _calls(gate, [(0, 1, ["a0"]), (1, 1, ["b-poison"]), (0, 1, ["a1", "a2"])])
    assert isinstance(out["b-poison"], BackendError)
    assert out["a1"] == ["A1", "A2"]
    together, *parts = backend.calls[1:]
    assert sorted(together) == ["a1", "a2", "b-poison"]
    assert sorted(parts) == [["a1", "a2"], ["b-poison"]]


def test_a_batch_passed_over_by_three_calls_runs_next_whatever_its_tier() -> None:
    backend = _Backend(seconds=0.02)
    gate = Gate(backend, max_inputs=2, hold_s=0.05)
    stop, out = threading.Event(), {}

    def enterprise_fills_every_call() -> None:
        i = 0
        while not stop.is_set():
            gate.call(0, 0, [f"e{i}", f"e{i}b"], None)
            i += 1

    loop = _start(enterprise_fills_every_call)
    wait_for(lambda: backend.calls, 2, "the enterprise loop")
    _start(lambda: _call(gate, 1, 2, ["free"], out)).join(5)
    stop.set()
    loop.join(5)
    assert out == {"free": ["FREE"]}
    assert gate.call(1, 2, [], None) == []  # (nothing to run: no wait)


def test_the_gate_waits_a_moment_for_the_shards_of_the_last_call_unless_they_pass() -> None:
    backend = _Backend(seconds=0.0)
    gate = Gate(backend, max_inputs=10, hold_s=0.5)
    gate.call(0, 0, ["a"], None)  # (shard 0 ran last: the gate expects it back)
    started = time.monotonic()
    gate.pass_turn(0)  # (it had nothing more)
    assert gate.call(1, 2, ["b"], None) == ["B"]
    assert time.monotonic() - started < 0.4


# -- a deployment on two shards ------------------------------------------------------


@pytest.fixture
def two_redis() -> Iterator[list[RedisServer]]:
    servers = [RedisServer().start(), RedisServer().start()]
    try:
        yield servers
    finally:
        for server in servers:
            server.close()


def _keys_by_shard(urls: list[str], tier: str, per_shard: int) -> list[list[str]]:
    names = [shards.identity(u) for u in urls]
    found: list[list[str]] = [[] for _ in urls]
    i = 0
    while any(len(f) < per_shard for f in found):
        key_id = f"{tier[:3]}-{i}"
        i += 1
        shard = found[shards.shard_of(key_id, names)]
        if len(shard) < per_shard:
            shard.append(key_id)
    return found


def _policy(keys: list[str], tier_of: Callable[[str], str], **extra: Any) -> str:
    entries = tuple(key_entry(k, tier_of(k), "s-" + k, **extra.get(k, {})) for k in keys)
    return as_yaml(policy(extra_keys=entries, max_batch_size=10))


def _infer(url: str, key_id: str, text: str, timeout: float = 30.0) -> tuple[int, Any]:
    status, _, body = http(
        "POST",
        url + "/v1/inference",
        {"input": text},
        {"Authorization": "Bearer s-" + key_id},
        timeout=timeout,
    )
    return status, body


def test_both_shards_carry_load_and_every_request_gets_its_own_answer(
    tmp_path: Path, two_redis: list[RedisServer]
) -> None:
    urls = [s.url for s in two_redis]
    ent, fre = _keys_by_shard(urls, "enterprise", 2), _keys_by_shard(urls, "free", 2)
    keys = [k for group in (*ent, *fre) for k in group]
    text = _policy(keys, lambda k: "enterprise" if k.startswith("ent") else "free")
    with Cluster(tmp_path, " ".join(urls), text, gateways=2, workers=2) as cluster:
        _wait_both_shards(cluster)
        jobs = [(cluster.urls[i % 2], keys[i % len(keys)], f"input {i}") for i in range(240)]
        with ThreadPoolExecutor(48) as pool:
            answers = list(pool.map(lambda j: _infer(*j), jobs))
        for (_, _key_id, sent), (status, body) in zip(jobs, answers, strict=True):
            assert status == 200, body
            assert body["output"].endswith(sent)
        clients = [redis.Redis.from_url(u) for u in urls]
        for client in clients:
            assert stats(client).get("requests_batched", 0) >= 60  # (each about half)
        wait_for(lambda: all(_clean(c) for c in clients), 10, "both shards left clean")
        for client in clients:
            assert_redis_clean(client)
        status, _, ready = http("GET", cluster.urls[0] + "/readyz")
        assert (status, ready["shards"], ready["shards_ready"]) == (200, 2, 2)


def _wait_both_shards(cluster: Cluster) -> None:
    for url in cluster.urls:
        wait_for(
            lambda u=url: (
                http("GET", u + "/readyz")[2]["shards_ready"] == 2
                and all(
                    http("GET", f"{u}/v1/status?shard={i}", headers=ADMIN)[2]["workers_alive"] == 2
                    for i in (0, 1)
                )
            ),
            30,
            "both shards ready with both workers",
        )


def _clean(client: redis.Redis) -> bool:
    try:
        assert_redis_clean(client)
    except AssertionError:
        return False
    return True


def test_a_quota_is_exact_over_two_gateways_on_each_shard(
    tmp_path: Path, two_redis: list[RedisServer]
) -> None:
    urls = [s.url for s in two_redis]
    (a,), (b,) = _keys_by_shard(urls, "paid", 1)
    limited = {k: {"rate_limits": ["25/minute"]} for k in (a, b)}
    text = _policy([a, b], lambda k: "paid", **limited)
    with Cluster(tmp_path, " ".join(urls), text, gateways=2, workers=2) as cluster:
        _wait_both_shards(cluster)
        jobs = [(cluster.urls[i % 2], key, f"q {key} {i}") for key in (a, b) for i in range(60)]
        with ThreadPoolExecutor(40) as pool:
            answers = list(pool.map(lambda j: _infer(*j), jobs))
        for key in (a, b):
            mine = [s for (_, k, _), (s, _) in zip(jobs, answers, strict=True) if k == key]
            assert mine.count(200) == 25, (key, sorted(set(mine)))
            assert mine.count(429) == 35


def test_a_shard_that_dies_refuses_only_its_keys_and_the_other_is_served(
    tmp_path: Path, two_redis: list[RedisServer]
) -> None:
    urls = [s.url for s in two_redis]
    (alive, *_), (doomed, *_) = _keys_by_shard(urls, "enterprise", 2)
    text = _policy([alive, doomed], lambda k: "enterprise")
    with Cluster(tmp_path, " ".join(urls), text, gateways=2, workers=2) as cluster:
        _wait_both_shards(cluster)
        results: dict[str, list[tuple[int, float]]] = {alive: [], doomed: []}
        stop = threading.Event()

        def load(key_id: str, n: int) -> None:
            i = 0
            while not stop.is_set():
                started = time.monotonic()
                status, _ = _infer(cluster.urls[i % 2], key_id, f"{key_id} {n} {i}", timeout=20)
                results[key_id].append((status, time.monotonic() - started))
                i += 1

        threads = [_start(lambda k=k, n=n: load(k, n)) for k in (alive, doomed) for n in range(4)]
        wait_for(lambda: len(results[doomed]) >= 20, 30, "load on both shards")
        two_redis[1].kill()
        killed_at = {k: len(v) for k, v in results.items()}
        wait_for(lambda: len(results[alive]) >= killed_at[alive] + 60, 60, "the live shard served")
        # What was waiting on the dead shard ends at its deadline (504); new
        # requests of its keys are refused at once (503).
        refused = lambda: [t for s, t in results[doomed][killed_at[doomed] :] if s == 503]  # noqa: E731
        wait_for(lambda: len(refused()) >= 8, 60, "the dead shard's keys refused")
        stop.set()
        for thread in threads:
            thread.join(30)
        assert not any(t.is_alive() for t in threads)  # (every request answered)
        assert {s for s, _ in results[alive]} == {200}
        assert {s for s, _ in results[doomed][killed_at[doomed] :]} <= {200, 503, 504}
        assert max(refused()) < 5.0
        status, _, ready = http("GET", cluster.urls[1] + "/readyz")
        assert (status, ready["shards_ready"]) == (200, 1)
        # The shard back (empty: its Redis kept nothing): its keys are served again.
        two_redis[1].restart()
        wait_for(lambda: _infer(cluster.urls[0], doomed, "back")[0] == 200, 60, "shard back")
        assert_redis_clean(redis.Redis.from_url(urls[0]))


def test_the_priority_between_tiers_holds_across_shards_within_one_batch(
    tmp_path: Path, two_redis: list[RedisServer]
) -> None:
    """One worker, enterprise work on one shard and free work on the other,
    sent together: the free requests answered before the last enterprise
    one are a batch at the start, and one a batch passed over by three
    calls (taking turns would answer half)."""
    urls = [s.url for s in two_redis]
    (ent, *_), _ = _keys_by_shard(urls, "enterprise", 1)
    _, (fre, *_) = _keys_by_shard(urls, "free", 1)
    text = _policy([ent, fre], lambda k: "enterprise" if k == ent else "free")
    with Cluster(tmp_path, " ".join(urls), text, gateways=1, workers=1) as cluster:
        for url in cluster.urls:
            wait_for(lambda u=url: http("GET", u + "/readyz")[2]["shards_ready"] == 2, 30, "shards")
        jobs = [(ent if i % 2 else fre, f"p {i}") for i in range(120)]
        done: list[tuple[float, str, int]] = []

        def one(job: tuple[str, str]) -> None:
            status, _ = _infer(cluster.urls[0], *job)
            done.append((time.monotonic(), job[0], status))

        with ThreadPoolExecutor(120) as pool:
            list(pool.map(one, jobs))
        assert {s for _, _, s in done} == {200}
        done.sort()
        last_enterprise = max(i for i, (_, key, _) in enumerate(done) if key == ent)
        free_before = sum(1 for _, key, _ in done[:last_enterprise] if key == fre)
        print(f"free answered before the last enterprise: {free_before} of 60 (batch 10)")
        assert free_before <= 30


def test_two_sentinel_setups_whose_services_share_a_name_are_two_shards_once_named(
    tmp_path: Path,
) -> None:
    sides = ("east", "west")
    setups: list[SentinelSet] = []
    try:
        for side in sides:
            (tmp_path / side).mkdir()
            setups.append(SentinelSet(tmp_path / side))
        unnamed = " ".join(s.url for s in setups)  # (both say /infergate/0)
        refused = subprocess.run(
            [sys.executable, "-m", "infergate", "dispatcher"],
            env={**os.environ, "REDIS_URL": unnamed},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert refused.returncode == 2, refused.stderr
        assert "'#name' at the end of its URL" in refused.stderr
        urls = [f"{s.url}#{side}" for s, side in zip(setups, sides, strict=True)]
        keys = [k for group in _keys_by_shard(urls, "paid", 2) for k in group]
        with Cluster(tmp_path, " ".join(urls), _policy(keys, lambda k: "paid"), workers=2) as c:
            _wait_both_shards(c)
            sent = [(c.urls[0], keys[i % len(keys)], f"named {i}") for i in range(40)]
            with ThreadPoolExecutor(8) as pool:
                answers = list(pool.map(lambda j: _infer(*j), sent))
            for (_, _, text), (status, body) in zip(sent, answers, strict=True):
                assert status == 200, body
                assert body["output"] == sim_output(text)
            for setup in setups:  # each setup's primary ran its keys' half
                assert stats(setup.client()).get("requests_batched", 0) >= 20
    finally:
        for setup in setups:
            setup.close()


def test_a_job_stays_found_and_cancellable_when_a_new_shard_takes_its_key(
    tmp_path: Path, two_redis: list[RedisServer]
) -> None:
    urls = [s.url for s in two_redis]
    _, (moved, *_) = _keys_by_shard(urls, "paid", 1)  # the second shard's, once it is added
    text = _policy([moved], lambda k: "paid")
    owner = {"Authorization": "Bearer s-" + moved}

    def job(base: str, method: str, job_id: str, query: str = "") -> tuple[int, Any]:
        status, _, body = http(method, f"{base}/v1/jobs/{job_id}{query}", headers=owner)
        return status, body

    (tmp_path / "one").mkdir()
    with Cluster(tmp_path / "one", urls[0], text) as one:
        one.stop_workers()
        submitted = [
            http("POST", one.urls[0] + "/v1/jobs", {"input": t}, owner)[2]["job_id"]
            for t in ("runs where it was", "cancelled after the move")
        ]
    runs, cancelled = submitted
    # No dispatcher at first, and none's batching rule left (it lapses a few
    # seconds after the last one stops): a worker takes nothing without one,
    # so nothing runs until the checks are made.
    old_shard = redis.Redis.from_url(urls[0])
    wait_for(lambda: not old_shard.exists(KEYS.batch_rule), 15, "the old batching rule to lapse")
    (tmp_path / "two").mkdir()
    with Cluster(tmp_path / "two", " ".join(urls), text, dispatchers=0) as two:
        base = two.urls[0]
        assert job(base, "GET", runs)[1]["status"] == "queued"
        status, body = job(base, "DELETE", cancelled)
        assert (status, body["status"]) == (200, "cancelled"), body
        assert job(base, "GET", "0" * 32)[0] == 404
        two.add_dispatcher()
        finished = lambda: job(base, "GET", runs, "?wait_s=5")[1]["status"] == "succeeded"  # noqa: E731
        wait_for(finished, 60, "the job to run on the shard it was queued on")
        status, body = job(base, "GET", runs)
        assert status == 200, body
        assert body["result"]["output"] == sim_output("runs where it was")
        assert job(base, "GET", cancelled)[1]["status"] == "cancelled"
        # The shard it was on gone: not "no such job" (it may be there), but 503.
        two_redis[0].kill()
        status, body = job(base, "GET", runs)
        assert status == 503, body
