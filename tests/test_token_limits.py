"""Token limits (policy ``token_limits``): a request reserves its input's
bound and its max_tokens as it is admitted, and gives back what it did not
use once answered, so the tokens charged in any window never exceed the
limit, across gateways. Real processes on a real Redis."""

import asyncio
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis as sync_redis
import redis.asyncio
from infergate.redis_server import RedisServer

from tests.helpers import (
    KEYS,
    Cluster,
    as_yaml,
    auth,
    http,
    key_entry,
    policy,
    policy_yaml,
    wait_for,
)

TEMPLATE_TOKENS = 16  # (gateway/reservations.py: what an input's bound adds)
WINDOW_S = 2
LIMIT = 600
# Every answer of the simulated backend is its input after one word of its own.
SIM_WORDS = 1


def reserves(text: str, max_tokens: int) -> int:
    return len(text.encode()) + TEMPLATE_TOKENS + max_tokens


def used(text: str, max_tokens: int) -> int:
    """What a simulated answer uses: its input's words, and its output's
    (cut at max_tokens)."""
    words = len(text.split())
    return words + min(words + SIM_WORDS, max_tokens)


def tokens_policy(limit: str = f"{LIMIT}/{WINDOW_S} seconds") -> str:
    metered = key_entry("metered", "paid", "metered-secret", token_limits=[limit])
    return policy_yaml(extra_keys=(metered,))


METERED = {"Authorization": "Bearer metered-secret"}


def metered(url: str, text: str, max_tokens: int) -> tuple[int, dict[str, str], Any]:
    """A request of the metered key."""
    body = {"input": text, "parameters": {"max_tokens": max_tokens}}
    return http("POST", url + "/v1/inference", body, METERED)


def test_a_request_is_charged_what_it_used_and_told_what_is_left(cluster_factory) -> None:
    """The first request reserves its bound and gives back the rest as it is
    answered: the second's headers count what the first used, exactly."""
    c = cluster_factory(tokens_policy("5000/hour"), latency_ms=10)
    first, second = "one two three", "four five"
    status, headers, body = metered(c.urls[0], first, 50)
    assert status == 200, body
    assert headers["x-ratelimit-limit-tokens"] == "5000"
    # (before it is answered: its whole reservation)
    assert int(headers["x-ratelimit-remaining-tokens"]) == 5000 - reserves(first, 50)
    assert body["metadata"]["tokens_used"] == len(first.split()) + SIM_WORDS
    status, headers, body = metered(c.urls[0], second, 2)
    assert status == 200, body
    assert body["metadata"]["tokens_used"] == 2  # (cut at its max_tokens)
    left = 5000 - used(first, 50) - reserves(second, 2)
    assert int(headers["x-ratelimit-remaining-tokens"]) == left
    # A key without token limits gets no token headers.
    status, headers, body = http(
        "POST", c.urls[0] + "/v1/inference", {"input": "a b c"}, auth("paid")
    )
    assert status == 200
    assert "x-ratelimit-limit-tokens" not in headers


def test_a_request_that_does_not_fit_gets_429_and_one_that_never_can_no_retry(
    cluster_factory,
) -> None:
    metered_key = key_entry("metered", "paid", "metered-secret", token_limits=["100/hour"])
    doc = policy_yaml(extra_keys=(metered_key,), tiers={"paid": {"cost_limit": "60/minute"}})
    c = cluster_factory(doc, latency_ms=300)
    status, headers, body = metered(c.urls[0], "x", 500)
    assert status == 429, body
    assert "retry-after" not in headers  # (no wait makes room for it)
    assert "can never be admitted" in body["error"]["message"]
    # Over the characters a minute as a whole: told so (its tokens fit).
    status, headers, body = metered(c.urls[0], "y" * 61, 1)
    assert status == 429, body
    assert "retry-after" not in headers
    message = body["error"]["message"]
    assert "input of 61 characters" in message, message
    assert "can never be admitted" in message, message
    assert "tokens" not in message, message
    # Five at once, each reserving 2 + 16 + 20 = 38 of 100: two fit, three
    # are refused; once answered, the two give back all but the 3 each used.
    with ThreadPoolExecutor(5) as pool:
        replies = list(
            pool.map(
                lambda i: metered(c.urls[0], f"w{i}", 20),
                range(5),
            )
        )
    assert sorted(status for status, _, _ in replies) == [200, 200, 429, 429, 429]
    for status, headers, body in replies:
        if status == 429:
            assert body["error"]["code"] == "RATE_LIMITED"
            assert "tokens" in body["error"]["message"]
            assert headers["x-ratelimit-limit-tokens"] == "100"
            assert int(headers["retry-after"]) >= 1
    status, headers, body = metered(c.urls[0], "w5", 20)
    assert status == 200, body
    assert int(headers["x-ratelimit-remaining-tokens"]) == 100 - 2 * 3 - 38


async def test_two_gateways_and_fifty_clients_never_overshoot_the_limit(
    tmp_path: Path, cluster_factory
) -> None:
    """One key, two gateways, 50 clients at once with mixed max_tokens: in
    every span of one window, the tokens of the requests admitted within it
    (sent and answered inside it) stay within the limit; and the limit is
    used, not merely kept."""
    c = cluster_factory(tokens_policy(), gateways=2, workers=2, latency_ms=20)
    duration_s = 3 * WINDOW_S
    records: list[tuple[float, float, int]] = []  # (sent, answered, tokens used)
    refused = 0

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=100)) as session:

        async def client(n: int) -> None:
            nonlocal refused
            i = 0
            end = time.monotonic() + duration_s
            while time.monotonic() < end:
                i += 1
                words = " ".join(f"c{n}w{j}" for j in range(1 + (n + i) % 6))
                max_tokens = (2, 8, 30)[(n + i) % 3]
                sent = time.monotonic()
                async with session.post(
                    c.urls[n % 2] + "/v1/inference",
                    json={"input": words, "parameters": {"max_tokens": max_tokens}},
                    headers=METERED,
                ) as r:
                    body = await r.json()
                    if r.status == 200:
                        tokens = len(words.split()) + body["metadata"]["tokens_used"]
                        assert tokens == used(words, max_tokens)
                        records.append((sent, time.monotonic(), tokens))
                    else:
                        assert r.status == 429, body
                        refused += 1
                        await asyncio.sleep(0.02)

        async def watch() -> None:
            """The most the window's eleven buckets (every span of one window
            overlaps at most eleven) held at once, reservations included."""
            nonlocal most
            store = redis.asyncio.Redis.from_url(c.redis_url)
            try:
                key, give_up = None, time.monotonic() + 10
                while key is None and time.monotonic() < give_up:
                    found = [k async for k in store.scan_iter(match="*metered*tokens*")]
                    key = found[0] if found else None
                    await asyncio.sleep(0.01)
                assert key is not None, "no token window in Redis"
                while not done.is_set():
                    most = max(most, int(await store.hget(key, "s") or 0))
                    await asyncio.sleep(0.002)
            finally:
                await store.aclose()

        done, most = asyncio.Event(), 0
        watching = asyncio.create_task(watch())
        await asyncio.gather(*(client(n) for n in range(50)))
        done.set()
        await asyncio.wait_for(watching, 5)

    assert refused > 0  # (the limit was reached)
    worst = max(
        sum(t for sent, answered, t in records if start <= sent and answered <= start + WINDOW_S)
        for start, _, _ in records
    )
    total = sum(t for _, _, t in records)
    use = total / (LIMIT * duration_s / WINDOW_S)
    print(f"worst window {worst} of {LIMIT}, in Redis {most}; mean use of the limit {use:.0%}")
    assert worst <= LIMIT
    assert 0 < most <= LIMIT
    assert use > 0.5


def test_a_policy_with_a_token_limit_that_is_not_a_rate_is_refused(tmp_path: Path) -> None:
    from infergate.policies import PolicyError, parse_policy

    bad = key_entry("k", "paid", "k-secret", token_limits=["lots"])
    with pytest.raises(PolicyError, match="token_limits"):
        parse_policy(policy_yaml(extra_keys=(bad,)))
    # (a window past a year would overflow its counters' expiry)
    long = key_entry("k", "paid", "k-secret", token_limits=["100000/1000000000 years"])
    with pytest.raises(PolicyError, match="a window over a year"):
        parse_policy(policy_yaml(extra_keys=(long,)))


def test_a_chat_is_bounded_by_the_text_the_model_reads(cluster_factory) -> None:
    """A chat rendered by the policy's template is longer than its messages'
    JSON: its reservation bounds the rendered text, so answered chats never
    use more than the limit (each of these uses some 904 tokens)."""
    metered = key_entry("metered", "paid", "metered-secret", token_limits=["4000/2 seconds"])
    doc = policy(extra_keys=(metered,))
    template = {"prefix": "a " * 900, "message": "{role}: {content}\n", "suffix": "assistant:"}
    doc["openai"] = {"chat_template": template}
    c = cluster_factory(as_yaml(doc), latency_ms=10)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    started = time.monotonic()
    replies = [http("POST", c.urls[0] + "/v1/chat/completions", chat, METERED) for _ in range(6)]
    assert time.monotonic() - started < WINDOW_S  # (all within one window)
    used_tokens = [body["usage"]["total_tokens"] for status, _, body in replies if status == 200]
    assert [status for status, _, _ in replies][-1] == 429
    assert 0 < sum(used_tokens) <= 4000, used_tokens


def test_a_metered_request_shares_only_an_answer_cut_as_it_reserved(cluster_factory) -> None:
    """An identical request in flight from a key that reserves nothing gets
    its answer uncut; a metered request that waited for it would take more
    tokens than it reserved (its model's 16). It shares only an answer cut
    as its own would be."""
    doc = policy(extra_keys=(key_entry("metered", "paid", "metered-secret", token_limits=["100000/hour"]),), sharing={"scope": "tier"})  # fmt: skip
    c = cluster_factory(as_yaml(doc), latency_ms=300)
    text = " ".join(f"w{i}" for i in range(40))  # (answered uncut: 41 words)

    async def both() -> list[tuple[int, dict]]:
        url = c.urls[0] + "/v1/inference"
        client = redis.asyncio.Redis.from_url(c.redis_url)
        async with aiohttp.ClientSession() as session:

            async def one(headers: dict[str, str]) -> tuple[int, dict]:
                async with session.post(url, json={"input": text}, headers=headers) as r:
                    return r.status, await r.json()

            unmetered = asyncio.create_task(one(auth("paid")))
            for _ in range(200):  # (10 s at most: until a worker has taken it)
                if int(await client.hget(KEYS.stats, "batches_formed") or 0):
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("no worker took the unmetered request")
            await client.aclose()
            return list(await asyncio.gather(unmetered, one(METERED)))

    (status, uncut), (metered_status, cut) = asyncio.run(both())
    assert (status, metered_status) == (200, 200), (uncut, cut)
    assert len(uncut["output"].split()) == 41
    assert len(cut["output"].split()) == 16, cut
    assert cut["metadata"]["tokens_used"] == 16


LONG_WORDS = "a " * 290


def dear_key_cluster(cluster_factory: Any, ms_per_ktoken: int = 100) -> Any:
    """A stack whose metered key is measured dear (it asks for long answers):
    past its share of the tier, a list of 100 long prompts has some refused
    as they queue, and is answered 503."""
    import yaml

    doc = yaml.safe_load(tokens_policy("1000000/minute"))
    doc["tiers"]["paid"]["deadline_ms"] = 60_000
    doc.pop("limits", None)
    c = cluster_factory(
        yaml.safe_dump(doc),
        latency_ms=40,
        worker_args=["--sim-ms-per-ktoken", str(ms_per_ktoken)],
    )
    for i in range(8):  # (its cost measured: each asks for long answers)
        body = {"model": "default", "prompt": f"t{i} {LONG_WORDS}", "max_tokens": 4096}
        status, _, answer = http("POST", c.urls[0] + "/v1/completions", body, METERED)
        assert status == 200, answer
    return c


def wait_until_charged_is_used(redis_url: str) -> None:
    """The key's token window ends holding what its requests used, no more."""
    client = sync_redis.Redis.from_url(redis_url)
    try:
        (window,) = client.scan_iter(match="*metered*tokens*")

        def charged_is_used() -> bool:
            used = sum(
                int(client.hget(name, f"paid\nmetered\n{field}") or 0)
                for name in client.scan_iter(match="*usage*")
                if client.type(name) == b"hash"
                for field in ("input_tokens", "output_tokens")
            )
            return int(client.hget(window, "s") or 0) == used

        wait_for(charged_is_used, 20, "the window to hold what was used")
    finally:
        client.close()


def test_a_list_refused_partway_gives_back_what_its_unqueued_prompts_reserved(
    cluster_factory,
) -> None:
    """The dear key's list of 100 long prompts is answered 503. The prompts
    that never queued give back their parts of the list's reservation
    (before, they gave back only their request and character counts: the
    window held 211,032 tokens against 41,976 used)."""
    c = dear_key_cluster(cluster_factory)
    prompts = [f"p{i} {LONG_WORDS}" for i in range(100)]
    body = {"model": "default", "prompt": prompts, "max_tokens": 4096}
    status, _, answer = http("POST", c.urls[0] + "/v1/completions", body, METERED)
    assert status == 503, answer
    wait_until_charged_is_used(c.redis_url)


def test_a_follower_cancelled_with_its_list_gives_back_what_it_reserved(
    cluster_factory,
) -> None:
    """One prompt of the dear key's list is identical to a request in
    flight, so it follows that request; the list is answered 503 while it
    follows, which cancels it. It ran nothing and gives back all it
    reserved (before, nothing settled it: round five's race held 274 s of
    a 300 s budget against 7 s used)."""
    c = dear_key_cluster(cluster_factory, ms_per_ktoken=800)
    shared = f"shared {'b ' * 990}"  # (1.6 s: the leader is in flight throughout)
    url = c.urls[0] + "/v1/completions"
    client = sync_redis.Redis.from_url(c.redis_url)
    (window,) = client.scan_iter(match="*metered*tokens*")
    trained = int(client.hget(window, "s") or 0)
    with ThreadPoolExecutor(1) as pool:
        leader = pool.submit(
            http, "POST", url, {"model": "default", "prompt": shared, "max_tokens": 4096}, METERED
        )
        # Admitted (its reservation in the window), it leads: the list's copy follows it.
        wait_for(lambda: int(client.hget(window, "s") or 0) > trained, 10, "the leader's admit")
        client.close()
        prompts = [shared] + [f"p{i} {LONG_WORDS}" for i in range(99)]
        body = {"model": "default", "prompt": prompts, "max_tokens": 4096}
        status, _, answer = http("POST", url, body, METERED)
        assert status == 503, answer
        assert not leader.done(), "the leader answered before its follower was cancelled"
        status, _, answer = leader.result(60)
        assert status == 200, answer
    wait_until_charged_is_used(c.redis_url)


def test_a_follower_whose_time_runs_out_gives_back_what_it_reserved(cluster_factory) -> None:
    """A request identical to one in flight follows it, and its time runs
    out while it follows: it never queued, so it gives back all it
    reserved, and the window ends holding only what the leader used
    (before, the follower's reservation stayed in it)."""
    c = cluster_factory(tokens_policy("100000/minute"), latency_ms=600)
    body = {"input": "shared words here", "parameters": {"max_tokens": 50}}
    url = c.urls[0] + "/v1/inference"

    async def both() -> list[int]:
        async with aiohttp.ClientSession() as session:

            async def send(extra: dict[str, Any], delay_s: float) -> int:
                await asyncio.sleep(delay_s)  # pacing: the leader is in flight first
                async with session.post(url, json={**body, **extra}, headers=METERED) as r:
                    await r.read()
                    return r.status

            return await asyncio.gather(send({}, 0), send({"timeout_ms": 300}, 0.1))

    assert asyncio.run(both()) == [200, 504]
    client = sync_redis.Redis.from_url(c.redis_url)
    try:
        (window,) = client.scan_iter(match="*metered*tokens*")
        leader = used(body["input"], 50)
        wait_for(
            lambda: int(client.hget(window, "s") or 0) == leader,
            10,
            "the window to hold the leader's",
        )
    finally:
        client.close()


def test_a_504_is_not_held_up_by_a_redis_that_stalls(
    tmp_path: Path, own_redis: RedisServer
) -> None:
    """A request past its deadline leaves what it reserved for the take in
    the background: its 504 comes at its deadline while Redis does not
    answer, not after the client's socket timeout (it waited on it before)."""
    # (its batch runs 2.5 s: it waits out its deadline)
    with Cluster(tmp_path, own_redis.url, tokens_policy("5000/hour"), latency_ms=2500) as c:
        client = sync_redis.Redis.from_url(own_redis.url)
        assert own_redis.proc is not None
        body = {"input": "one two", "parameters": {"max_tokens": 5}, "timeout_ms": 1000}
        with ThreadPoolExecutor(1) as pool:
            sent = time.monotonic()
            answer = pool.submit(http, "POST", c.urls[0] + "/v1/inference", body, METERED)
            # Admitted: its reservation is in its key's token window.
            wait_for(lambda: client.keys("*LIMITER/metered/tokens*"), 5, "the reservation")
            os.kill(own_redis.proc.pid, signal.SIGSTOP)
            try:
                status, _, reply = answer.result(timeout=10)
                took = time.monotonic() - sent
            finally:
                os.kill(own_redis.proc.pid, signal.SIGCONT)
        client.close()
        assert status == 504, reply
        assert reply["error"]["code"] == "TIMEOUT"
        # (the deadline it was given: not what was left of it when it queued)
        assert reply["error"]["message"] == "no result within the 1000 ms deadline"
        assert took < 1.0 + 1.0, took  # (the socket timeout would add 2 s and more)
