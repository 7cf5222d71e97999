"""A batch endpoint to infergate's JSON contract (``http:URL``), a real
server process (``tests/user_backends/batch_server.py``) behind a real
stack: one call a batch, and every fault a server has: killed mid-batch,
500, 4xx, the wrong number of outputs, hanging, slow, and down for a while.
A server that does not answer makes its workers unhealthy within a
heartbeat: new requests get a prompt 503, nothing accepted is lost, and the
workers come back by themselves with it."""

import concurrent.futures
import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from infergate.redis_server import RedisServer

from tests.helpers import Cluster, as_yaml, http, policy, wait_for
from tests.upstreams import Server, batch_server, completions_server

TIMEOUT_MS = 6_000


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with batch_server(tmp_path_factory.mktemp("batch-server")) as s:
        yield s


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, module_redis: RedisServer, server: Server
) -> Iterator[Cluster]:
    doc = policy()
    doc["models"] = {
        "default": {
            "backend": f"http:{server.url}/infer",
            "options": {"timeout_ms": TIMEOUT_MS, "health_path": "/health", "max_tokens": True},
        }
    }
    with Cluster(
        tmp_path_factory.mktemp("http-backend"), module_redis.url, as_yaml(doc), workers=2
    ) as c:
        # Both warmed up (a worker beats once warm): a warm-up's 202 inputs
        # to the server would otherwise fall into the first test's count.
        wait_for(lambda: c.serving(c.urls[0], "default") >= 2, 60, "both workers warm")
        yield c
        c.assert_workers_whole()


def _calls(server: Server) -> dict:
    with urllib.request.urlopen(server.url + "/calls", timeout=5) as resp:
        return json.loads(resp.read())


def _said_down(c: Cluster) -> int:
    """How many times the workers logged their server gone."""
    return sum(w.output().count("upstream.down") for w in c.workers)


def _all(c: Cluster, texts: list[str], **extra: object) -> list[tuple[int, dict]]:
    with concurrent.futures.ThreadPoolExecutor(len(texts)) as pool:
        return list(pool.map(lambda t: c.infer("paid", t, **extra)[::2], texts))


def test_a_batch_is_one_call_with_every_input(cluster: Cluster, server: Server) -> None:
    before = _calls(server)
    answers = _all(cluster, [f"hello {i}" for i in range(40)])
    after = _calls(server)
    assert all(status == 200 for status, _ in answers), answers
    assert {body["output"].rsplit(" (", 1)[0] for _, body in answers} == {
        f"HELLO {i}" for i in range(40)
    }
    assert after["inputs"] - before["inputs"] == 40
    assert after["calls"] - before["calls"] < 40  # (batched: several inputs a call)
    # Its own token counts are the answer's.
    _, body = answers[0]
    assert body["metadata"]["tokens_used"] == len(body["output"])


def test_max_tokens_is_passed_when_the_endpoint_says_it_honours_it(
    cluster: Cluster, server: Server
) -> None:
    before = _calls(server)
    status, _, body = cluster.infer("paid", "limit me", parameters={"max_tokens": 4})
    assert status == 200, body
    assert _calls(server)["parameters"] == before["parameters"] + 1
    status, _, body = cluster.infer("paid", "sample me", parameters={"temperature": 0.5})
    assert status == 400  # (sampling: not declared)


@pytest.mark.parametrize("marker", ["__500__", "__400__", "__count__"])
def test_a_batch_the_server_fails_fails_only_the_input_at_fault(
    cluster: Cluster, marker: str
) -> None:
    texts = [f"fine {i}" for i in range(15)] + [f"poisoned {marker}"]
    answers = _all(cluster, texts)
    for text, (status, body) in zip(texts, answers, strict=True):
        if marker in text:
            assert (status, body["error"]["code"]) == (500, "INFERENCE_FAILED"), body
        else:
            assert status == 200, body
            assert body["output"].startswith(text.upper())


def test_a_slow_server_is_not_a_hung_one(cluster: Cluster) -> None:
    status, _, body = cluster.infer("paid", "take your time __slow__")
    assert status == 200, body
    assert body["latency_ms"] > 1_400


def test_a_call_cut_short_by_its_deadline_leaves_the_server_up(cluster: Cluster) -> None:
    """A 1.5 s call for a request of 0.8 s times out on the request's
    deadline, not the server's bound: the server is not said to be down."""
    said_down = _said_down(cluster)
    status, _, body = cluster.infer("paid", "in a hurry __slow__", timeout_ms=800)
    assert status in (503, 504), body
    assert _said_down(cluster) == said_down
    assert cluster.infer("paid", "after the hurry")[0] == 200


def test_a_hanging_call_is_bounded_and_answered_503(cluster: Cluster) -> None:
    """Past the call's bound (its timeout_ms, within the deadline) the
    request is answered 503, to be retried; the worker lives on."""
    started = time.monotonic()
    status, headers, body = cluster.infer("paid", "never mind __hang__")
    took = time.monotonic() - started
    assert (status, body["error"]["code"]) == (503, "SERVICE_OVERLOADED"), body
    assert "did not answer" in body["error"]["message"]
    assert "retry-after" in headers
    assert TIMEOUT_MS / 1000 - 0.5 < took < 9
    wait_for(lambda: cluster.infer("paid", "after the hang")[0] == 200, 15, "serving again")


def test_a_server_killed_mid_batch_and_back_loses_nothing(cluster: Cluster, server: Server) -> None:
    """Killed while it runs a batch, started again a moment later: the
    call is tried again within the deadline, and every request is answered
    with its own output."""
    texts = [f"through the crash {i} __slow__" for i in range(5)]
    answers: list = []
    inputs_before = _calls(server)["inputs"]
    said_down = _said_down(cluster)
    runner = threading.Thread(target=lambda: answers.extend(_all(cluster, texts)))
    runner.start()
    # The whole batch in the server's hands (it takes 1.5 s), then killed.
    wait_for(lambda: _calls(server)["inputs"] >= inputs_before + 5, 10, "the batch to arrive")
    server.kill()
    # A worker has found it gone (its call tried again meanwhile): back.
    wait_for(lambda: _said_down(cluster) > said_down, 10, "a worker to see the server gone")
    server.start()
    runner.join(30)
    assert [status for status, _ in answers] == [200] * 5, answers
    assert {b["output"].rsplit(" (", 1)[0] for _, b in answers} == {t.upper() for t in texts}


def test_a_server_down_takes_its_workers_out_and_they_come_back(
    cluster: Cluster, server: Server
) -> None:
    server.stop()
    # Within a heartbeat of their next call (or probe), the workers say
    # their server is down: a new request gets a prompt 503, not a 504.
    status, _, _ = cluster.infer("paid", "while it is down")
    wait_for(
        lambda: (
            all(w["upstream_down"] for w in cluster.status()["workers"])
            and http("GET", cluster.urls[0] + "/readyz")[2]["workers_alive"] == 0
        ),
        10,
        "the workers to say their server is down",
    )
    started = time.monotonic()
    status, headers, body = cluster.infer("paid", "refused at once")
    assert (status, body["error"]["code"]) == (503, "SERVICE_OVERLOADED"), body
    assert "retry-after" in headers
    assert time.monotonic() - started < 3.0  # (not its 10 s deadline)
    server.start()
    wait_for(
        lambda: not any(w["upstream_down"] for w in cluster.status()["workers"]),
        15,
        "the workers to come back",
    )
    status, _, body = cluster.infer("paid", "served again")
    assert (status, body["output"].rsplit(" (", 1)[0]) == (200, "SERVED AGAIN")


def test_a_worker_starts_before_its_server_and_waits_for_it(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A worker whose server is not up yet waits for it (no crash loop),
    and joins once it answers."""
    late = batch_server(tmp_path)
    worker = cluster.add_worker(args=["--backend", f"http:{late.url}/infer"])
    try:
        wait_for(lambda: "worker.upstream_waiting" in worker.output(), 30, "the worker to wait")
        assert worker.alive()
        late.start()
        wait_for(lambda: cluster.status()["workers_alive"] == 3, 30, "the late worker to join")
        assert not any(w["upstream_down"] for w in cluster.status()["workers"])
    finally:
        worker.stop()
        cluster.killed = [*cluster.killed, worker]
        late.stop()


# -- openai: with a server that takes a list of prompts --------------------------------


def test_an_engine_that_takes_lists_gets_one_call_a_batch(tmp_path: Path, redis_url: str) -> None:
    """vLLM's wire (``user_backends/completions_server.py``): a batch is one
    call with its prompts, one call per distinct max_tokens; its tokens are
    the server's count, its total shared by length; a prompt it refuses
    fails alone (the batch is split)."""
    with completions_server(tmp_path) as engine:
        doc = policy()
        doc["models"] = {"default": {"backend": f"openai:{engine.url}/v1", "max_new_tokens": 32}}
        with Cluster(tmp_path, redis_url, as_yaml(doc), workers=1) as c:
            before = json.loads(urllib.request.urlopen(engine.url + "/calls").read())
            texts = [f"one two three {i}" for i in range(20)] + ["x __refuse__"]
            answers = _all(c, texts, parameters={"max_tokens": 3})
            after = json.loads(urllib.request.urlopen(engine.url + "/calls").read())
            for text, (status, body) in zip(texts, answers, strict=True):
                if "__refuse__" in text:
                    assert (status, body["error"]["code"]) == (500, "INFERENCE_FAILED"), body
                    assert "over the context" in body["error"]["message"]
                else:
                    assert (status, body["output"]) == (200, "ONE TWO THREE"), body
                    assert body["metadata"]["tokens_used"] == 3
            # Fewer calls than prompts, though the refused one was split down to.
            assert after["calls"] - before["calls"] < 20


def test_pacing_does_not_hold_requests_for_workers_that_keep_several_batches() -> None:
    """Pacing staggers backends that run one batch at a time; an engine's
    slots (--concurrency) take a request whenever it comes: held by pacing,
    a lone request waited a batch time over the slots (400 ms here)."""
    from types import SimpleNamespace

    from infergate.base import wire
    from infergate.base.fleet import FleetView
    from infergate.base.queue.store import FleetSnapshot
    from infergate.dispatcher.service import BatchRule, Dispatcher

    def interval(slots: int) -> int:
        view = FleetView(store=None)  # type: ignore[arg-type]
        beats = [
            wire.Heartbeat("worker", f"w.{i}", 0, 0, batch_ms=1600.0, slots=slots) for i in range(4)
        ]
        view.snapshot = FleetSnapshot(beats, {}, 0)
        rule = BatchRule(max_batch_size=100, pacing=True)
        return Dispatcher.pacing_interval_ms(SimpleNamespace(fleet=view), rule)  # type: ignore[arg-type]

    assert interval(slots=1) == 400  # (four workers of one batch at a time: staggered)
    assert interval(slots=4) == 0
