"""Inference servers this project did not write, behind a real stack:
Triton (through PyTriton) speaking the Open Inference Protocol
(``kserve-v2:``), and ``transformers serve``, OpenAI-compatible on the CPU
(``openai:``). Each serves ``/v1/inference`` and the OpenAI routes through
separate worker processes and through ``up``, keeps the contract's faults
to the inputs at fault, and a server that goes away and comes back loses
nothing. Their venvs come from ``.ci/upstreams`` (these tests skip without
them)."""

import concurrent.futures
import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from infergate.redis_server import RedisServer

from tests.helpers import SECRETS, Cluster, Stack, as_yaml, http, policy, wait_for
from tests.upstreams import (
    Server,
    openai_python,
    tiny_model,
    transformers_server,
    triton_python,
    triton_server,
)

needs_triton = pytest.mark.skipif(triton_python() is None, reason="no PyTriton (.ci/upstreams)")
needs_engine = pytest.mark.skipif(
    openai_python() is None, reason="no transformers serve (.ci/upstreams)"
)


def _all(c: Cluster, texts: list[str], **extra: object) -> list[tuple[int, dict]]:
    with concurrent.futures.ThreadPoolExecutor(len(texts)) as pool:
        return list(pool.map(lambda t: c.infer("paid", t, **extra)[::2], texts))


# -- Triton, the Open Inference Protocol (kserve-v2:) -------------------------------------


@pytest.fixture(scope="module")
def triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    if triton_python() is None:
        pytest.skip("no PyTriton (.ci/upstreams)")
    with triton_server(tmp_path_factory.mktemp("triton")) as server:
        yield server


@pytest.fixture(scope="module")
def triton_stack(
    tmp_path_factory: pytest.TempPathFactory, module_redis: RedisServer, triton: Server
) -> Iterator[Cluster]:
    doc = policy()
    doc["models"] = {
        "echo": {"backend": f"kserve-v2:{triton.url}", "options": {"model": "echo"}},
        "raw": {"backend": f"kserve-v2:{triton.url}", "options": {"model": "echo_raw"}},
    }
    with Cluster(
        tmp_path_factory.mktemp("kserve"),
        module_redis.url,
        as_yaml(doc),
        models={"echo": 2, "raw": 1},
    ) as c:
        yield c
        c.assert_workers_whole()


@needs_triton
def test_triton_serves_batches_through_the_stack(triton_stack: Cluster) -> None:
    texts = [f"to triton {i} é日本" for i in range(40)]
    answers = _all(triton_stack, texts, model="echo")
    assert [status for status, _ in answers] == [200] * 40, answers[:3]
    assert [body["output"] for _, body in answers] == [t.upper() for t in texts]
    assert max(body["batch_size"] for _, body in answers) > 1
    assert answers[0][1]["metadata"]["model_version"].startswith("kserve-v2/")


@needs_triton
def test_triton_behind_the_openai_routes(triton_stack: Cluster) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=triton_stack.urls[0] + "/v1", api_key=SECRETS["paid"], max_retries=0)
    completion = client.completions.create(model="echo", prompt=["one", "two"])
    assert [c.text for c in completion.choices] == ["ONE", "TWO"]


@needs_triton
@pytest.mark.parametrize(("model", "marker"), [("echo", "__fail__"), ("raw", "__short__")])
def test_a_batch_triton_fails_fails_only_the_input_at_fault(
    triton_stack: Cluster, model: str, marker: str
) -> None:
    texts = [f"fine {i}" for i in range(12)] + [f"poisoned {marker}"]
    answers = _all(triton_stack, texts, model=model)
    for text, (status, body) in zip(texts, answers, strict=True):
        if marker in text:
            assert (status, body["error"]["code"]) == (500, "INFERENCE_FAILED"), body
        else:
            assert (status, body["output"]) == (200, text.upper()), body


@needs_triton
def test_what_a_kserve_model_cannot_do_is_refused(triton_stack: Cluster) -> None:
    status, _, body = triton_stack.infer("paid", "hi", model="echo", parameters={"temperature": 1})
    assert (status, body["error"]["code"]) == (400, "INVALID_INPUT")
    assert "does not sample" in body["error"]["message"]


@needs_triton
def test_triton_killed_and_back_its_workers_leave_and_return(
    triton_stack: Cluster, triton: Server
) -> None:
    triton.kill()
    # (the gateway's own view: it counts no worker of either model)
    wait_for(
        lambda: http("GET", triton_stack.urls[0] + "/readyz")[2]["workers_alive"] == 0,
        20,
        "the workers to say Triton is down",
    )
    started = time.monotonic()
    status, headers, body = triton_stack.infer("paid", "while it is down", model="echo")
    assert (status, body["error"]["code"]) == (503, "SERVICE_OVERLOADED"), body
    assert "retry-after" in headers
    assert time.monotonic() - started < 3.0  # (not its 10 s deadline)
    triton.start()
    wait_for(
        lambda: triton_stack.infer("paid", "back", model="echo")[0] == 200,
        60,
        "Triton to serve again",
    )


@needs_triton
def test_up_serves_a_triton_model(tmp_path: Path, redis_url: str, triton: Server) -> None:
    options = json.dumps({"model": "echo"})
    extra = ["--backend", f"kserve-v2:{triton.url}", "--backend-options", options]
    with Stack(tmp_path, redis_url, workers=1, extra_args=extra, policy=as_yaml(policy())) as stack:
        status, _, body = stack.infer("paid", "through up")
        assert status == 200, body
        assert body["output"] == "THROUGH UP"


# -- transformers serve, OpenAI-compatible (openai:) --------------------------------------


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    if openai_python() is None:
        pytest.skip("no transformers serve (.ci/upstreams)")
    home = tmp_path_factory.mktemp("engine")
    with transformers_server(home, tiny_model(home / "tiny-gpt2")) as server:
        yield server


@pytest.fixture(scope="module")
def engine_stack(
    tmp_path_factory: pytest.TempPathFactory, module_redis: RedisServer, engine: Server
) -> Iterator[Cluster]:
    doc = policy()
    # (a CPU engine: small batches keep its warm-up short)
    doc["models"] = {
        "tiny": {
            "backend": f"openai:{engine.url}",
            "max_new_tokens": 8,
            "batching": {"max_batch_size": 8},
        }
    }
    with Cluster(
        tmp_path_factory.mktemp("openai"),
        module_redis.url,
        as_yaml(doc),
        models={"tiny": 1},
        worker_args=["--concurrency", "4"],
    ) as c:
        yield c
        c.assert_workers_whole()


def _engine_completion(engine: Server, prompt: str, max_tokens: int) -> dict:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    request = urllib.request.Request(
        engine.url + "/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        return json.loads(resp.read())


@needs_engine
def test_an_engine_answers_as_it_would_directly_with_its_own_counts(
    engine_stack: Cluster, engine: Server
) -> None:
    direct = _engine_completion(engine, "the quick brown fox", 5)
    status, _, body = engine_stack.infer(
        "paid", "the quick brown fox", model="tiny", parameters={"max_tokens": 5}
    )
    assert status == 200, body
    assert body["output"] == direct["choices"][0]["text"]  # (greedy: the same text)
    assert body["metadata"]["tokens_used"] == direct["usage"]["completion_tokens"] == 5


@needs_engine
def test_an_engine_worker_keeps_its_slots_in_flight(engine_stack: Cluster) -> None:
    """--concurrency 4: four slots, each a worker to the fleet."""
    assert engine_stack.status()["workers_alive"] == 4
    texts = [f"hello world {i}" for i in range(16)]
    answers = _all(engine_stack, texts, model="tiny", parameters={"max_tokens": 3})
    assert [s for s, _ in answers] == [200] * 16, answers[:2]


@needs_engine
def test_an_engine_behind_the_openai_client(engine_stack: Cluster) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=engine_stack.urls[0] + "/v1", api_key=SECRETS["paid"], max_retries=0)
    completion = client.completions.create(model="tiny", prompt="hello", max_tokens=4)
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 4
    sampled = client.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=1.0)
    assert sampled.usage is not None
    assert 0 < sampled.usage.completion_tokens <= 4, sampled  # (sampled, within max_tokens)
    too_many = engine_stack.infer("paid", "hi", model="tiny", parameters={"max_tokens": 9})
    assert too_many[0] == 400  # (over the model's max_new_tokens, 8)
