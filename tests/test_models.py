"""Several models behind one gateway: the design documents' request shape,
routing by ``model``, who may use which model, each model's own key space
(a model without workers refuses only its own requests), and what the
parameters do. Real processes and a real Redis."""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import redis
from infergate.base.keys import Keys
from infergate.gpu.backend import clip_words
from infergate.gpu.backends.simulated import sim_output
from infergate.policies import PolicyError, parse_policy

from tests.helpers import as_yaml, auth, http, key_entry, policy, wait_for

MODELS = {
    "small": {"backend": "simulated"},
    # Only the enterprise tier, and of it one key, may use "large".
    "large": {"backend": "simulated", "tiers": ["enterprise"], "keys": ["ent"]},
}


def models_policy(**extra: Any) -> str:
    doc = policy(extra_keys=(key_entry("ent2", "enterprise", "test-ent2-secret"),))
    doc["models"] = MODELS
    doc.update(extra)
    return as_yaml(doc)


def infer(url: str, body: dict[str, Any], tier: str = "enterprise") -> tuple[int, dict[str, Any]]:
    status, _, payload = http("POST", url + "/v1/inference", body, auth(tier))
    return status, payload


def test_keys_of_a_model_are_its_own_and_the_deployments_are_shared() -> None:
    default, large = Keys("ig"), Keys("ig", "large")
    assert default.queue("free") == "{ig}:queue:free"  # a single-model deployment's, unchanged
    assert large.queue("free") == "{ig}:m:large:queue:free"
    assert large.fair_queue("paid").startswith("{ig}:m:large:")
    assert large.heartbeat("worker", "w").startswith("{ig}:m:large:")
    # A key's quotas, replies, jobs and the policy are the deployment's.
    for name in ("quota_prefix", "policy", "jobs_done", "job_prefix", "cancelled", "jobs_queued"):
        assert getattr(large, name) == getattr(default, name)
    assert large.reply_channel("g") == default.reply_channel("g")
    with pytest.raises(ValueError, match="model name"):
        Keys("ig", "a:b")


@pytest.mark.parametrize(
    ("models", "extra", "says"),
    [
        ({"m": {"tiers": ["gold"]}}, {}, "unknown tier 'gold'"),
        ({"m": {"keys": ["nobody"]}}, {}, "no key has the id 'nobody'"),
        (
            {"m": {"backend": "onnx"}},
            {},
            "'onnx' is not a backend; write simulated, transformers, python:pkg.module:attr",
        ),
        ({"m": {"backend": "transformers"}}, {}, "needs the model's folder"),
        ({"a b": {}}, {}, "must be 1-64 letters"),
        ({f"m{i}": {} for i in range(65)}, {}, "at most 64 models"),
        ({"m": {"batching": {"max_batch_size": 500}}}, {}, "models.m.batching.max_batch_size"),
        ({"m": {"workers": {"hang_timeout_ms": 5}}}, {}, "must be at least 100"),
        ({"m": {"temperature": 1}}, {}, "unknown field"),
        ({"m": {}}, {"default_model": "x"}, "'x' is not a listed model"),
    ],
)
def test_a_models_section_that_cannot_work_is_refused_with_its_place(
    models: dict[str, Any], extra: dict[str, Any], says: str
) -> None:
    doc = policy()
    doc["models"] = models
    doc.update(extra)
    with pytest.raises(PolicyError) as refused:
        parse_policy(as_yaml(doc), "p.yaml")
    assert says in str(refused.value)


def test_a_models_view_has_its_own_batching_and_the_default_is_the_first() -> None:
    doc = policy()
    doc["models"] = {"a": {}, "b": {"batching": {"max_batch_size": 8}}}
    parsed = parse_policy(as_yaml(doc))
    assert parsed.default_model == "a"
    assert parsed.for_model("b").document.batching.max_batch_size == 8
    assert parsed.for_model("a") is parsed
    assert list(parse_policy(as_yaml(policy())).models) == ["default"]


def test_words_are_the_simulated_tokens() -> None:
    assert clip_words("a  b c", 2) == ("a  b", 2)
    assert clip_words("a b", 5) == ("a b", 2)
    assert clip_words(" x ", 0) == (" x ", 1)


def test_two_models_on_one_gateway_route_refuse_and_answer_the_documents_shape(
    cluster_factory: Any,
) -> None:
    cluster = cluster_factory(models_policy(), models={"small": 1, "large": 1}, latency_ms=20)
    url = cluster.urls[0]
    # The design documents' own request.
    status, body = infer(
        url,
        {
            "model": "large",
            "input": "hello there, world",
            "parameters": {"temperature": 0.7, "max_tokens": 100},
        },
    )
    assert status == 200, body
    assert body["model"] == "large"
    assert body["output"].startswith("sim/large[")
    assert set(body["metadata"]) == {"tokens_used", "latency_ms", "model_version"}
    assert body["metadata"]["model_version"] == "simulated/1/large"
    assert body["metadata"]["tokens_used"] == len(body["output"].split())
    # No model: the policy's default (the first listed), its output greedy.
    status, body = infer(url, {"input": "plain"}, "paid")
    assert (status, body["model"], body["output"]) == (
        200,
        "small",
        sim_output("plain", 0, "small"),
    )
    # max_tokens cuts the output to that many of the backend's tokens.
    status, body = infer(url, {"input": "one two three four", "parameters": {"max_tokens": 2}})
    assert body["output"] == "sim/small[" + body["output"].split("[")[1].split()[0] + " one"
    assert body["metadata"]["tokens_used"] == 2
    # Unknown model 404, a model this key may not use 403, a parameter no
    # backend honours 400 naming it: none of them queued or charged.
    status, body = infer(url, {"model": "huge", "input": "x"})
    assert (status, body["error"]["code"]) == (404, "MODEL_NOT_FOUND")
    status, body = infer(url, {"model": "large", "input": "x"}, "paid")
    assert (status, body["error"]["code"]) == (403, "FORBIDDEN")
    status, _, raw = http(
        "POST",
        url + "/v1/inference",
        {"model": "large", "input": "x"},
        {"Authorization": "Bearer test-ent2-secret"},
    )
    assert status == 403, raw
    status, body = infer(url, {"input": "x", "parameters": {"top_p": 0.9}})
    assert status == 400
    assert "top_p" in body["error"]["message"]
    # /v1/models: what the calling key may use.
    status, _, raw = http("GET", url + "/v1/models", None, auth("enterprise"))
    assert status == 200
    assert [m["id"] for m in raw["data"]] == ["small", "large"]
    status, _, raw = http("GET", url + "/v1/models", None, auth("paid"))
    assert [m["id"] for m in raw["data"]] == ["small"]
    status, _, _ = http("GET", url + "/v1/models", None, {})
    assert status == 401


def test_sampled_requests_are_never_collapsed_and_greedy_ones_are(cluster_factory: Any) -> None:
    cluster = cluster_factory(models_policy(), models={"small": 1, "large": 1}, latency_ms=200)
    url = cluster.urls[0]

    def send(temperature: float) -> dict[str, Any]:
        params = {"temperature": temperature} if temperature else {}
        status, body = infer(url, {"model": "small", "input": "same", "parameters": params})
        assert status == 200, body
        return body

    with ThreadPoolExecutor(8) as pool:
        sampled = list(pool.map(send, [1.0] * 4))
        greedy = list(pool.map(send, [0.0] * 4))
    assert len({b["output"] for b in sampled}) == 4  # four draws
    assert all(b["served_by"] == "model" for b in sampled)
    assert len({b["output"] for b in greedy}) == 1


def test_a_model_without_workers_refuses_only_its_own_requests(cluster_factory: Any) -> None:
    cluster = cluster_factory(models_policy(), models={"small": 1, "large": 1}, latency_ms=20)
    url = cluster.urls[0]
    large_worker = next(w for w in cluster.workers if "large" in w.log_path.name)
    cluster.kill(large_worker)

    def large_refused() -> bool:
        status, body = infer(url, {"model": "large", "input": "x", "timeout_ms": 500})
        return status == 503 and "'large'" in body["error"]["message"]

    wait_for(large_refused, 10, "the large model to have no worker")
    for i in range(20):
        status, body = infer(url, {"model": "small", "input": f"still {i}"})
        assert (status, body["model"]) == (200, "small")
    # Its refusals are in its own usage, not the other model's.

    def refused(model: str) -> int:
        status, _, body = http("GET", f"{url}/v1/admin/usage?model={model}", None, auth("admin"))
        assert status == 200, body
        return sum(k["refused"] for k in body["keys"])

    wait_for(lambda: refused("large") > 0, 15, "the large model's refusals in its usage")
    assert refused("small") == 0
    # Each model's queues and workers are in its own key space.
    client = redis.Redis.from_url(cluster.redis_url)
    try:
        assert client.scard(Keys("infergate", "small").members("worker")) == 1
        assert client.exists(Keys("infergate", "small").heartbeat("gateway", "")) == 0
        small_beats = client.keys("{infergate}:m:small:hb:gateway:*")
        assert len(small_beats) == 1  # the gateway beats in each model's space
    finally:
        client.close()


def test_a_single_model_policy_answers_as_before_with_its_model_named(
    cluster_factory: Any,
) -> None:
    cluster = cluster_factory(as_yaml(policy()), workers=1, latency_ms=20)
    status, body = infer(cluster.urls[0], {"input": "as before"}, "free")
    assert status == 200
    assert body["output"] == sim_output("as before")
    assert body["model"] == "default"
    assert body["metadata"]["model_version"] == "simulated/1"
    status, body = infer(cluster.urls[0], {"model": "default", "input": "named"}, "free")
    assert status == 200


def test_redis_out_of_memory_is_one_state_for_every_models_store() -> None:
    from infergate.base.queue.store import Store

    client = redis.Redis()  # (never connects: no command is sent)
    root = Store(client, Keys("ig"))  # type: ignore[arg-type]
    large = root.of_model("large")
    large.saw_full()
    assert root.full
    root.full = False
    assert not large.full
    assert root.of_model("default") is root


def test_up_models_gives_every_process_its_own_metrics_port(tmp_path: Path) -> None:
    from infergate.main import build_parser
    from infergate.policies.demo import demo_policy
    from infergate.up import _children

    args = build_parser().parse_args(
        ["up", "--models", "small=2,large=1", "--metrics-port", "9100", "--gateways", "2"]
    )
    text, _ = demo_policy()
    policy = tmp_path / "policy.yaml"
    policy.write_text(text + "\nmodels:\n  small: {}\n  large: {}\n", "utf-8")
    children = _children(args, str(policy), [])
    ports = [c.argv[c.argv.index("--metrics-port") + 1] for c in children]
    assert len(ports) == len(set(ports)) == 3 + 2 + 2
    named = {c.name: c.argv for c in children}
    assert named["worker-large-3"][named["worker-large-3"].index("--model-name") + 1] == "large"
    assert "--model-name" in named["dispatcher-small-1"]


def test_no_input_can_name_a_sampled_requests_slot() -> None:
    from infergate.base import wire
    from infergate.gpu.backend_thread import distinct_inputs

    def env(request_id: str, text: str, temperature: float = 0.0) -> wire.Envelope:
        return wire.Envelope(request_id, "g", "paid", "k", text, 0, 1, temperature=temperature)

    job = "0e35a851" * 4  # a job's id, which its owner (and its logs) can see
    prompts = distinct_inputs(
        [env(job, "secret", 1.0), env("r2", "\0" + job), env("r3", "\0" + job), env("r4", "x", 1.0)]
    )
    assert list(prompts) == ["secret", "\0" + job, "x"]
    assert prompts.temperatures == [1.0, 0.0, 1.0]


def test_a_model_the_policy_drops_loses_its_lane(cluster_factory: Any) -> None:
    from tests.helpers import write_policy

    cluster = cluster_factory(models_policy(), models={"small": 1, "large": 1}, latency_ms=20)
    url = cluster.urls[0]
    client = redis.Redis.from_url(cluster.redis_url)
    try:
        assert client.keys("{infergate}:m:large:hb:gateway:*")
        doc = policy(extra_keys=(key_entry("ent2", "enterprise", "test-ent2-secret"),))
        doc["models"] = {"small": MODELS["small"]}
        write_policy(cluster.policy_path, doc)
        wait_for(lambda: infer(url, {"model": "large", "input": "x"})[0] == 404, 10, "large to go")
        wait_for(
            lambda: not client.keys("{infergate}:m:large:hb:gateway:*"),
            10,
            "the gateway's heartbeat in the dropped model's space to go",
        )
        assert infer(url, {"model": "small", "input": "still here"})[0] == 200
    finally:
        client.close()


def test_a_gateways_beat_for_a_model_it_is_not_serving_rests(cluster_factory: Any) -> None:
    """A policy of many models has a beat for each in every gateway: those
    that say nothing new rest (a longer TTL, less often); a model's beat is
    back at its interval while its requests come."""
    cluster = cluster_factory(models_policy(), models={"small": 1, "large": 1}, latency_ms=20)
    url = cluster.urls[0]
    client = redis.Redis.from_url(cluster.redis_url)

    def ttl_ms(model: str) -> int:
        (key,) = client.keys(Keys("infergate", model).heartbeat("gateway", "*"))
        return int(client.pttl(key))

    try:
        wait_for(lambda: ttl_ms("small") > 1_000, 15, "the small model's beat to rest")
        serving: list[int] = []
        for i in range(40):  # (a request every 50 ms or so: one or more in every 250 ms)
            status, body = infer(url, {"model": "small", "input": f"news {i}"})
            assert status == 200, body
            if i >= 10:
                serving.append(ttl_ms("small"))
            assert ttl_ms("large") > 1_000
        # (a beat that found no request since the last rests: a slow request may leave one)
        assert sum(0 < ttl <= 1_000 for ttl in serving) >= len(serving) * 0.8, serving
    finally:
        client.close()
