"""The OpenAI-compatible surface, driven by the official ``openai`` client
(sync and async) against a real stack: completions (one prompt and a list),
chat, streaming, the models, errors in OpenAI's shape and when the client is
told not to retry; and the bodies' own rules, read without a stack."""

import asyncio
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from infergate.gateway.calls import Fanout
from infergate.gateway.errors import ApiError
from infergate.gateway.openai_api import read_chat, read_completion, render_chat
from infergate.gpu.backends.simulated import sim_output
from infergate.policies.schema import ChatTemplate
from infergate.redis_server import RedisServer

from tests.helpers import SECRETS, Cluster, as_yaml, http, policy, redis_clean, wait_for

MODELS = {
    "small": {"backend": "simulated"},
    "large": {"backend": "simulated", "tiers": ["enterprise"]},
}


def openai_policy(**extra: Any) -> str:
    doc = policy(tiers={"free": {"rate_limits": ["3/minute"]}})
    doc["models"] = MODELS
    doc.update(extra)
    return as_yaml(doc)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, module_redis: RedisServer) -> Iterator[str]:
    cluster = Cluster(
        tmp_path_factory.mktemp("openai"),
        module_redis.url,
        openai_policy(),
        models={"small": 2, "large": 1},
        latency_ms=20,
    )
    yield cluster.urls[0]
    cluster.stop()


_opened: list[openai.OpenAI] = []


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while _opened:
        _opened.pop().close()


def client(url: str, tier: str = "paid", api_key: str | None = None, **kw: Any) -> openai.OpenAI:
    """A client of the tests' key of ``tier`` (closed after the test)."""
    made = openai.OpenAI(base_url=url + "/v1", api_key=api_key or SECRETS[tier], **kw)
    _opened.append(made)
    return made


def test_completions_one_prompt_and_a_list(stack: str) -> None:
    c = client(stack)
    one = c.completions.create(model="small", prompt="hello there", max_tokens=50)
    assert one.object == "text_completion"
    assert one.model == "small"
    assert one.choices[0].text == sim_output("hello there", model="small")
    assert one.choices[0].finish_reason == "stop"
    assert one.choices[0].index == 0
    # usage in the simulated backend's tokens (words), the input's counted by the worker
    assert (one.usage.prompt_tokens, one.usage.completion_tokens) == (2, 3)
    assert one.usage.total_tokens == 5
    assert one.system_fingerprint
    prompts = [f"prompt number {i}" for i in range(7)]
    many = c.completions.create(model="small", prompt=prompts)
    assert [ch.index for ch in many.choices] == list(range(7))
    assert [ch.text for ch in many.choices] == [sim_output(p, model="small") for p in prompts]
    assert many.usage.prompt_tokens == 21
    cut = c.completions.create(model="small", prompt="one two three four", max_tokens=2)
    assert cut.choices[0].finish_reason == "length"
    assert cut.usage.completion_tokens == 2


def test_chat_renders_the_last_user_message_by_default(stack: str) -> None:
    reply = client(stack).chat.completions.create(
        model="small",
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "first question"},
            {"role": "assistant", "content": "an answer"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "second "},
                    {"type": "text", "text": "question"},
                ],
            },
        ],
    )
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == sim_output("second question", model="small")
    assert reply.choices[0].finish_reason == "stop"


def test_streams_are_openai_chunks_then_done(stack: str) -> None:
    c = client(stack)
    chunks = list(
        c.chat.completions.create(
            model="small",
            messages=[{"role": "user", "content": "stream this"}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == sim_output("stream this", model="small")
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 3
    parts = list(c.completions.create(model="small", prompt=["a b", "c d"], stream=True))
    by_choice: dict[int, str] = {}
    for part in parts:
        for ch in part.choices:
            by_choice[ch.index] = by_choice.get(ch.index, "") + ch.text
    assert by_choice == {0: sim_output("a b", model="small"), 1: sim_output("c d", model="small")}
    # On the wire: Server-Sent Events, unbuffered by proxies, ending [DONE].
    status, headers, body = http(
        "POST",
        stack + "/v1/completions",
        {"model": "small", "prompt": "raw", "stream": True},
        {"Authorization": "Bearer " + SECRETS["paid"]},
    )
    assert status == 200
    assert headers["content-type"].startswith("text/event-stream")
    assert headers["x-accel-buffering"] == "no"
    events = body.decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert json.loads(events[0].removeprefix("data: "))["choices"][0]["text"] == sim_output(
        "raw", model="small"
    )


def test_models_are_the_keys_own(stack: str) -> None:
    assert [m.id for m in client(stack).models.list()] == ["small"]
    assert [m.id for m in client(stack, "enterprise").models.list()] == ["small", "large"]
    assert client(stack).models.retrieve("small").id == "small"
    with pytest.raises(openai.NotFoundError) as missing:
        client(stack).models.retrieve("large")  # (exists, but not for this key)
    assert missing.value.code == "model_not_found"
    assert client(stack, "enterprise").models.retrieve("large").owned_by == "infergate"


def test_fifty_concurrent_calls_async(stack: str) -> None:
    async def run() -> list[str]:
        c = openai.AsyncOpenAI(base_url=stack + "/v1", api_key=SECRETS["enterprise"])
        calls = [
            c.chat.completions.create(
                model="large" if i % 2 else "small",
                messages=[{"role": "user", "content": f"question {i}"}],
            )
            for i in range(25)
        ] + [c.completions.create(model="small", prompt=f"prompt {i}") for i in range(25)]
        replies = await asyncio.gather(*calls)
        await c.close()
        return [
            r.choices[0].message.content if r.object == "chat.completion" else r.choices[0].text
            for r in replies
        ]

    outputs = asyncio.run(run())
    expected = [sim_output(f"question {i}", model="large" if i % 2 else "small") for i in range(25)]
    expected += [sim_output(f"prompt {i}", model="small") for i in range(25)]
    assert outputs == expected


def test_fifty_concurrent_calls_sync(stack: str) -> None:
    """One sync client shared by 50 threads (its connection pool is thread-safe)."""
    c = client(stack, "enterprise")

    def call(i: int) -> str:
        if i % 2:
            reply = c.chat.completions.create(
                model="small", messages=[{"role": "user", "content": f"sync question {i}"}]
            )
            return reply.choices[0].message.content or ""
        return c.completions.create(model="small", prompt=f"sync prompt {i}").choices[0].text

    with ThreadPoolExecutor(50) as pool:
        outputs = list(pool.map(call, range(50)))
    assert outputs == [
        sim_output(f"sync {'question' if i % 2 else 'prompt'} {i}", model="small")
        for i in range(50)
    ]


def test_errors_are_openais_and_a_spent_quota_costs_one_call(stack: str) -> None:
    c = client(stack)
    with pytest.raises(openai.NotFoundError) as missing:
        c.completions.create(model="nope", prompt="x")
    assert (missing.value.code, missing.value.param) == ("model_not_found", "model")
    with pytest.raises(openai.BadRequestError) as bad:
        c.completions.create(model="small", prompt="x", n=2)
    assert (bad.value.code, bad.value.param) == ("invalid_input", "n")
    with pytest.raises(openai.BadRequestError) as unknown:
        c.completions.create(model="small", prompt="x", extra_body={"top_k": 5})
    assert unknown.value.param == "top_k"
    with pytest.raises(openai.BadRequestError) as long:
        c.completions.create(model="small", prompt="x" * 2001)
    assert long.value.param == "prompt"
    assert long.value.response.headers["x-should-retry"] == "false"
    with pytest.raises(openai.AuthenticationError):
        client(stack, api_key="nope").completions.create(model="small", prompt="x")
    with pytest.raises(openai.PermissionDeniedError):
        client(stack, "disabled").chat.completions.create(
            model="small", messages=[{"role": "user", "content": "x"}]
        )
    with pytest.raises(openai.PermissionDeniedError) as forbidden:
        c.completions.create(model="large", prompt="x")
    assert forbidden.value.param == "model"
    # The free tier's 3/minute: the fourth call is 429, sent once (the client
    # retries 429 twice by default; x-should-retry: false stops it).
    sent: list[str] = []
    counting = httpx.Client(event_hooks={"request": [lambda r: sent.append(str(r.url))]})
    free = client(stack, "free", http_client=counting)
    for i in range(3):
        free.completions.create(model="small", prompt=f"quota {i}")
    with pytest.raises(openai.RateLimitError) as limited:
        free.completions.create(model="small", prompt="quota 3")
    headers = limited.value.response.headers
    assert headers["x-should-retry"] == "false"
    assert int(headers["retry-after"]) > 2
    assert len(sent) == 4, sent


def test_a_list_holds_one_connection_and_fails_whole(
    tmp_path: Path, own_redis: RedisServer
) -> None:
    """100 prompts on one connection take one of the key's holds (a share
    of 0.01 is 10 of 1000 connections here), and one prompt the tier
    refuses fails the call with nothing left queued."""
    text = as_yaml(policy(limits={"key_connection_share": 0.01}, max_batch_size=100))
    with Cluster(tmp_path, own_redis.url, text) as cluster:
        _list_holds_one_connection(cluster)


def _list_holds_one_connection(cluster: Cluster) -> None:
    c = client(cluster.urls[0], "enterprise")
    prompts = [f"item {i}" for i in range(100)]
    reply = c.completions.create(model="default", prompt=prompts)
    assert [ch.text for ch in reply.choices] == [sim_output(p) for p in prompts]
    with pytest.raises(openai.BadRequestError) as refused:
        c.completions.create(model="default", prompt=[*prompts[:50], "x" * 4001])
    assert refused.value.param == "prompt"
    assert refused.value.response.headers["x-should-retry"] == "false"
    client_redis = redis.Redis.from_url(cluster.redis_url)
    wait_for(lambda: redis_clean(client_redis), 10, "nothing left queued")
    client_redis.close()


def test_a_prompt_whose_client_left_is_told_at_once() -> None:
    """A prompt of a list that starts waiting after its client has gone is
    told at once (the connection's hook fired before it registered)."""

    async def run() -> list[str]:
        told: list[str] = []
        slot: list[Any] = []
        fanout = Fanout(lambda callback: slot.append(callback))
        fanout.hook_of(0)(lambda: told.append("first"))
        slot[0]()  # the connection is lost
        fanout.hook_of(1)(lambda: told.append("late"))
        await asyncio.sleep(0)  # (pacing: one turn of the loop runs call_soon)
        return told

    assert asyncio.run(run()) == ["first", "late"]


def test_the_openapi_document_describes_the_routes(stack: str) -> None:
    doc = http("GET", stack + "/schema/openapi.json")[2]
    completions = doc["paths"]["/v1/completions"]["post"]
    schema = completions["requestBody"]["content"]["application/json"]["schema"]
    assert {"prompt", "model", "max_tokens", "stream", "user"} <= set(schema["properties"])
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert "messages" in chat["requestBody"]["content"]["application/json"]["schema"]["properties"]
    assert {"200", "400", "401", "429"} <= set(chat["responses"])
    assert "get" in doc["paths"]["/v1/models/{model_id}"]


def test_a_policys_chat_template(cluster_factory: Any, tmp_path: Path) -> None:
    template = {"prefix": "<s>", "message": "{role}: {content}\n", "suffix": "assistant:"}
    cluster = cluster_factory(as_yaml({**policy(), "openai": {"chat_template": template}}))
    reply = client(cluster.urls[0]).chat.completions.create(
        model="default",
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
    )
    rendered = "<s>system: be brief\nuser: hi\nassistant:"
    assert reply.choices[0].message.content == sim_output(rendered)


# -- the bodies, without a stack -------------------------------------------------


def test_what_a_body_becomes() -> None:
    ask = read_completion(
        b'{"model": "m", "prompt": ["a", "b"], "max_tokens": 5, "temperature": 0.5, "user": "u1"}'
    )
    assert ask.inputs == ["a", "b"]
    assert ask.model == "m"
    assert not ask.chat
    assert ask.parameters is not None
    assert (
        ask.parameters.max_tokens,
        ask.parameters.temperature,
    ) == (5, 0.5)
    # OpenAI's neutral values are accepted; anything else names its field.
    read_completion(b'{"prompt": "a", "n": 1, "top_p": 1, "presence_penalty": 0, "echo": false}')
    for body, param in (
        (b'{"prompt": "a", "top_p": 0.5}', "top_p"),
        (b'{"prompt": "a", "stop": ["\\n"]}', "stop"),
        (b'{"prompt": "a", "logprobs": 2}', "logprobs"),
        (b'{"prompt": "a", "max_tokens": 0}', "max_tokens"),
        (b'{"prompt": "a", "temperature": 3}', "temperature"),
        (b'{"prompt": [1, 2]}', "prompt"),
        (b'{"prompt": []}', "prompt"),
        (b'{"prompt": ""}', "prompt"),
        (b'{"prompt": "a", "stream_options": {"include_usage": true}}', "stream_options"),
        (b'{"prompt": "a", "surprise": 1}', "surprise"),
        (
            b'{"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]}',
            "tools",
        ),
        # A message without content, or of no parts, or a part without text
        # (before: read as an empty turn, and the model run on the rest).
        (b'{"messages": [{"role": "system"}, {"role": "user", "content": "a"}]}', "messages"),
        (
            b'{"messages": [{"role": "system", "content": null}, {"role": "user", "content": "a"}]}',
            "messages",
        ),
        (b'{"messages": [{"role": "user", "content": []}]}', "messages"),
        (b'{"messages": [{"role": "user", "content": [{"type": "text"}]}]}', "messages"),
    ):
        with pytest.raises(ApiError) as refused:
            (read_chat(body, None) if b"messages" in body else read_completion(body))
        assert (refused.value.status, refused.value.param) == (400, param), body
    arrays, objects = b"[" * 2000 + b"]" * 2000, b'{"a":' * 2000 + b"1" + b"}" * 2000
    for field, nested in (
        (b"tools", arrays),
        (b"tool_choice", objects),
        (b"response_format", objects),
    ):
        body = (
            b'{"messages": [{"role": "user", "content": "a"}], "' + field + b'": ' + nested + b"}"
        )
        with pytest.raises(ApiError, match="nests too deeply"):
            read_chat(body, None)
    # The value refused is named, a string in quotes (an empty one too).
    with pytest.raises(ApiError, match=r"^suffix '' is not supported"):
        read_completion(b'{"prompt": "a", "suffix": ""}')
    with pytest.raises(ApiError, match=r"^n 2 is not supported"):
        read_completion(b'{"prompt": "a", "n": 2}')
    with pytest.raises(ApiError, match="list of 1-100"):
        read_completion(json.dumps({"prompt": ["a"] * 101}).encode())
    with pytest.raises(ApiError, match="no user message"):
        read_chat(b'{"messages": [{"role": "system", "content": "a"}]}', None)
    with pytest.raises(ApiError, match="only text content"):
        read_chat(
            b'{"messages": [{"role": "user", "content": [{"type": "image_url", "text": ""}]}]}',
            None,
        )
    chat = read_chat(
        b'{"messages": [{"role": "user", "content": "q"}], "max_completion_tokens": 7}', None
    )
    assert chat.parameters is not None
    assert chat.parameters.max_tokens == 7
    assert chat.chat


def test_a_template_replaces_only_its_two_names() -> None:
    """A message's content is text, never part of the template: braces in it
    stay braces."""
    from infergate.gateway.openai_api import ChatMessage

    template = ChatTemplate(message="[{role}] {content};", prefix="<", suffix=">")
    messages = [
        ChatMessage("user", "{role} {0.__class__} {content}"),
        ChatMessage("{content}", "x"),
    ]
    assert (
        render_chat(messages, template) == "<[user] {role} {0.__class__} {content};[{content}] x;>"
    )
