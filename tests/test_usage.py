"""Usage per key: every answered request charged its share of its batch's
backend time in the transaction that answers it, refusals added by the
gateways; read back by GET /v1/admin/usage and `infergate usage`. Real
processes on a real Redis."""

import asyncio
import csv
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import msgspec
import pytest
import redis
from infergate.base import wire
from infergate.base.keys import Keys
from infergate.base.queue import usage
from infergate.base.queue.store import Store
from infergate.base.queue.usage import Charge, shares
from infergate.gpu.answers import Answers, charges
from infergate.gpu.backend import BackendError, Counted
from infergate.gpu.backends.simulated import SimulatedBackend
from infergate.usage import as_csv

from tests.helpers import SECRETS, Cluster, auth, http, key_entry, policy_yaml, wait_for


def test_shares_add_up_to_the_call() -> None:
    assert usage.shares(100_000, 3) == [33_334, 33_333, 33_333]
    assert sum(usage.shares(7, 5)) == 7
    assert usage.shares(5, 0) == []


async def test_read_skips_what_it_cannot_read(redis_url: str) -> None:
    """Redis contents are not trusted: a field or value that is not a count,
    or a key of another type, is skipped, never a 500."""
    store = Store.connect(redis_url, "u", name="test")
    try:
        now_ms = 10 * usage.HOUR_MS + 5
        charges = [usage.Charge("k|1", "paid", 2, 20, 1500), usage.Charge("k2", "free", refused=4)]
        commands = usage.charge_commands(store, charges, now_ms, 3600)
        await store.pipelined.transaction(commands, (store.scripts.charge_usage,))
        hour = store.keys.usage(10)
        await store.redis.hset(hour, mapping={"junk": 1, "paid\nk|1\nrequests2": 1})
        await store.redis.hset(hour, "paid\nk|1\ngpu_us", "NaN")  # (replaces the real one)
        # Counts no charge writes: a sign, spaces, digits past any sum, no tier or key.
        await store.redis.hset(
            hour,
            mapping={
                "paid\nk|1\ninput_tokens": "-5",
                "paid\nk|1\noutput_tokens": " 7 ",
                "paid\nk|1\nrefused": "1" * 320,
                "gold\nk|1\nrequests": 1,
                "paid\n\nrequests": 1,
            },
        )
        await store.redis.set(store.keys.usage(9), "a string")
        rows = await usage.read(store, 9 * usage.HOUR_MS, now_ms)
        assert rows == [
            usage.KeyUsage("k|1", "paid", 2, 20, 0.0, 0, 0, 0),
            usage.KeyUsage("k2", "free", 0, 0, 0.0, 4, 0, 0),
        ]
        assert 0 < await store.redis.ttl(hour) <= 3600
        assert await usage.read(store, 9 * usage.HOUR_MS, now_ms, key_id="k2") == rows[1:]
    finally:
        await store.close()


async def test_usage_reads_per_key_and_hour_or_day_with_tokens(redis_url: str) -> None:
    store = Store.connect(redis_url, "u", name="test")
    day = 20_000 * usage.DAY_MS  # 2024-10-04, a UTC midnight
    try:
        for hour, charge in [
            (1, usage.Charge("a", "paid", 1, 10, 1000, 0, 3, 7)),
            (2, usage.Charge("a", "paid", 2, 20, 2000, 1, 6, 14)),
            (25, usage.Charge("a", "paid", 4, 40, 4000, 0, 12, 28)),
            (25, usage.Charge("b", "free", 1, 5, 9000, 0, 1, 2)),
        ]:
            now_ms = day + hour * usage.HOUR_MS
            commands = usage.charge_commands(store, [charge], now_ms, 86_400 * 3)
            await store.pipelined.transaction(commands, (store.scripts.charge_usage,))
        until = day + 30 * usage.HOUR_MS
        [b, a] = await usage.read(store, day, until)  # (most GPU time first)
        assert a == usage.KeyUsage("a", "paid", 7, 70, 7.0, 1, 21, 49)
        assert msgspec.json.decode(msgspec.json.encode(a))["input_tokens"] == 21
        assert "period" not in msgspec.json.decode(msgspec.json.encode(a))
        assert (b.input_tokens, b.output_tokens, b.period) == (1, 2, None)
        by_day = await usage.read(store, day, until, by="day")
        assert [(r.period, r.key_id, r.requests, r.output_tokens) for r in by_day] == [
            ("2024-10-04T00:00:00+00:00", "a", 3, 21),
            ("2024-10-05T00:00:00+00:00", "b", 1, 2),  # (more GPU time first, in a day)
            ("2024-10-05T00:00:00+00:00", "a", 4, 28),
        ]
        by_hour = await usage.read(store, day, until, key_id="a", by="hour")
        assert [(r.period, r.requests) for r in by_hour] == [
            ("2024-10-04T01:00:00+00:00", 1),
            ("2024-10-04T02:00:00+00:00", 2),
            ("2024-10-05T01:00:00+00:00", 4),
        ]
    finally:
        await store.close()


@pytest.fixture
def cluster(tmp_path: Path, redis_url: str):
    keys = (
        key_entry("u1", "paid", "u1-secret"),
        key_entry("u2", "free", "u2-secret"),
        key_entry("u3", "paid", "u3-secret", rate_limits=["2/minute"]),
    )
    c = Cluster(tmp_path, redis_url, policy_yaml(extra_keys=keys), workers=2)
    yield c
    c.stop()


def _usage_command(url: str, env: dict[str, str], *more: str) -> "subprocess.CompletedProcess[str]":
    return subprocess.run(
        [sys.executable, "-m", "infergate", "usage", "--url", url, *more],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )


def _gpu_ms_logged(c: Cluster) -> float:
    """The workers' backend time, from their batch.done lines."""
    total = 0
    for worker in c.workers:
        for line in worker.output().splitlines():
            if '"batch.done"' in line:
                total += json.loads(line)["infer_ms"]
    return float(total)


async def test_every_answered_request_is_charged_to_its_key(cluster: Cluster) -> None:
    c = cluster
    sends = [("u1-secret", i) for i in range(30)] + [("u2-secret", i) for i in range(10)]
    sends += [("u3-secret", i) for i in range(5)]
    async with aiohttp.ClientSession() as session:

        async def one(secret: str, i: int) -> int:
            async with session.post(
                c.urls[0] + "/v1/inference",
                json={"input": f"{secret}-{i}-" + "x" * i},
                headers={"Authorization": "Bearer " + secret},
            ) as r:
                return r.status

        statuses = await asyncio.gather(*(one(s, i) for s, i in sends))
    assert statuses.count(429) == 3
    assert statuses.count(200) == 42

    def report() -> dict:
        status, _, body = http("GET", c.urls[0] + "/v1/admin/usage", headers=auth("admin"))
        assert status == 200, body
        rows = {r["key_id"]: r for r in body["keys"]}
        # (the gateway adds its refusals every 5 s; the answers are there at
        # once, and the workers' log lines soon after them)
        logged = _gpu_ms_logged(c)
        total = sum(r["gpu_ms"] for r in body["keys"])
        done = rows.get("u3", {}).get("refused") == 3 and abs(total - logged) < 1e-6
        return body if done else {}

    body = await asyncio.to_thread(wait_for, report, 20, "usage with the refusals, as logged")
    rows = {r["key_id"]: r for r in body["keys"]}
    assert set(rows) == {"u1", "u2", "u3"}
    assert (rows["u1"]["tier"], rows["u1"]["requests"], rows["u1"]["refused"]) == ("paid", 30, 0)
    assert rows["u1"]["input_chars"] == sum(len(f"u1-secret-{i}-") + i for i in range(30))
    assert (rows["u2"]["requests"], rows["u3"]["requests"]) == (10, 2)
    # The model's tokens (the simulated one's are words): one an input, and its
    # answer "sim[crc32]: input" two.
    assert (rows["u1"]["input_tokens"], rows["u1"]["output_tokens"]) == (30, 60)
    assert (rows["u3"]["input_tokens"], rows["u3"]["output_tokens"]) == (2, 4)
    # The keys' GPU time adds up to the workers' backend time, to the microsecond.
    total = sum(r["gpu_ms"] for r in body["keys"])
    assert total == pytest.approx(_gpu_ms_logged(c), abs=1e-6)
    assert all(r["gpu_ms"] > 0 for r in rows.values())
    # One key, a sort, a start; a non-admin key, a bad start.
    one_key = http("GET", c.urls[0] + "/v1/admin/usage?key_id=u2", headers=auth("admin"))[2]
    assert [r["key_id"] for r in one_key["keys"]] == ["u2"]
    by_refused = http("GET", c.urls[0] + "/v1/admin/usage?sort=refused", headers=auth("admin"))[2]
    assert by_refused["keys"][0]["key_id"] == "u3"
    since = http(
        "GET", c.urls[0] + "/v1/admin/usage?since=2026-01-01T00:00Z", headers=auth("admin")
    )
    assert since[0] == 200
    assert len(since[2]["keys"]) == 3
    assert http("GET", c.urls[0] + "/v1/admin/usage", headers=auth("paid"))[0] == 403
    bad = http("GET", c.urls[0] + "/v1/admin/usage?since=yesterday", headers=auth("admin"))
    assert bad[0] == 400
    assert "since" in bad[2]["error"]["message"]
    assert http("GET", c.urls[0] + "/v1/admin/usage?sort=x", headers=auth("admin"))[0] == 400
    assert http("GET", c.urls[0] + "/v1/admin/usage?by=week", headers=auth("admin"))[0] == 400
    # A day's row counts its whole UTC day, whatever hour 'since' names.
    an_hour_ago = int(time.time()) - 3600
    daily_report = http(
        "GET", f"{c.urls[0]}/v1/admin/usage?by=day&since={an_hour_ago}", headers=auth("admin")
    )[2]
    assert daily_report["since"].endswith("T00:00:00+00:00")
    assert all(
        r["period"] == daily_report["since"] or r["period"] > daily_report["since"]
        for r in daily_report["keys"]
    )
    # The command prints the same as a table; without an admin key it says so.
    env = {**os.environ, "INFERGATE_ADMIN_KEY": SECRETS["admin"]}
    out = await asyncio.to_thread(_usage_command, c.urls[0], env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[1].split() == [
        "KEY", "TIER", "REQUESTS", "INPUT", "CHARS", "IN", "TOKENS", "OUT", "TOKENS", "GPU", "MS",
        "REFUSED",
    ]  # fmt: skip
    assert [line.split()[0] for line in lines[2:]] == [r["key_id"] for r in body["keys"]]
    # For billing: a row per key and UTC day, as CSV.
    out = await asyncio.to_thread(_usage_command, c.urls[0], env, "--by", "day", "--format", "csv")
    assert out.returncode == 0, out.stderr
    daily = list(csv.DictReader(io.StringIO(out.stdout)))
    assert list(daily[0]) == [
        "period", "key_id", "tier", "requests", "input_chars", "input_tokens", "output_tokens",
        "gpu_ms", "refused",
    ]  # fmt: skip
    # (a day's rows: one, or two where the run crossed midnight)
    assert {r["period"][11:] for r in daily} == {"00:00:00+00:00"}
    assert sum(int(r["requests"]) for r in daily if r["key_id"] == "u1") == 30
    assert sum(int(r["output_tokens"]) for r in daily if r["key_id"] == "u1") == 60
    env.pop("INFERGATE_ADMIN_KEY")
    bare = await asyncio.to_thread(_usage_command, c.urls[0], env)
    assert bare.returncode == 2
    assert "admin key" in bare.stderr


def test_an_answer_from_the_cache_is_in_usage_as_its_budget_counts_it(
    tmp_path: Path, redis_url: str
) -> None:
    """The same input twice, the second answered from the cache: usage
    counts both requests, and their tokens as the key's token budget was
    charged for them (the worker's count of the first, its input's bound
    and the answer's tokens for the second); the cache spent no GPU time
    (usage counted one request, and budgets two, before)."""
    budgeted = key_entry("b1", "paid", "b1-secret", budget={"tokens": 10_000, "period": "day"})
    doc = policy_yaml(extra_keys=(budgeted,), sharing={"cache_ttl_s": 60})
    c = Cluster(tmp_path, redis_url, doc, latency_ms=10)
    try:
        for _ in range(2):
            body = {"input": "the same words", "parameters": {"max_tokens": 20}}
            status, _, answer = http(
                "POST", c.urls[0] + "/v1/inference", body, {"Authorization": "Bearer b1-secret"}
            )
            assert status == 200, answer
        assert answer["served_by"] == "cache"
        client = redis.Redis.from_url(redis_url)
        [name] = list(client.scan_iter(match="*budget/b1/tokens/day"))
        charged = int(client.hget(name, "s") or 0)
        client.close()

        def row() -> dict | None:
            status, _, body = http("GET", c.urls[0] + "/v1/admin/usage", headers=auth("admin"))
            assert status == 200, body
            rows = [r for r in body["keys"] if r["key_id"] == "b1"]
            return rows[0] if rows and rows[0]["requests"] == 2 else None

        b1 = wait_for(row, 20, "usage with the answer from the cache")
        assert b1["input_tokens"] + b1["output_tokens"] == charged
        assert b1["output_tokens"] == 2 * len(answer["output"].split())
        assert b1["input_chars"] == 2 * len("the same words")
    finally:
        c.stop()


async def test_nothing_planted_in_usage_stops_an_answer(redis_url: str) -> None:
    """The charge runs in the transaction that answers a batch: a usage hash
    of another type, or a field HINCRBY cannot add to, starts over; the
    transaction never fails on it."""
    store = Store.connect(redis_url, "u", name="test")
    try:
        now_ms = 10 * usage.HOUR_MS
        hour = store.keys.usage(10)
        charges = [usage.Charge("k", "paid", 1, 10, 100)]
        for planted in ("a string", "abc", str(2**63 - 1)):
            await store.redis.delete(hour)
            if planted == "a string":
                await store.redis.set(hour, planted)
            else:
                await store.redis.hset(hour, "paid\nk\nrequests", planted)
            commands = usage.charge_commands(store, charges, now_ms, 3600)
            await store.pipelined.transaction(commands, (store.scripts.charge_usage,))
            rows = await usage.read(store, now_ms, now_ms)
            assert rows == [usage.KeyUsage("k", "paid", 1, 10, 0.1, 0, 0, 0)], planted
    finally:
        await store.close()


def test_the_command_reads_only_a_usage_report_and_follows_no_redirect() -> None:
    """`infergate usage` against a server that is not a gateway: a message,
    never a traceback; a redirect is not followed (it would carry the admin
    key); a key id's control characters never reach the terminal."""
    import http.server
    import threading

    answers = {
        "/list": (200, b"[1, 2]"),
        "/deep": (200, b"[" * 100_000),
        "/moved": (302, b""),
        "/report": (
            200,
            json.dumps({"keys": [{"key_id": "\x1b]0;x\x07", "tier": "paid"}]}).encode(),
        ),
    }

    class Fake(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, body = answers["/" + self.path.split("/")[1]]  # (+ /v1/admin/usage?...)
            self.send_response(status)
            if status == 302:
                self.send_header("Location", "http://127.0.0.1:9/steal")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Fake)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = {**os.environ, "INFERGATE_ADMIN_KEY": "x"}
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        for path in ("/list", "/deep", "/moved"):
            out = _usage_command(url + path, env)
            assert out.returncode == 1, path
            assert "Traceback" not in out.stderr, path
        assert "not followed" in _usage_command(url + "/moved", env).stderr
        report = _usage_command(url + "/report", env)
        assert report.returncode == 0
        assert "\x1b" not in report.stdout
        assert "\\x1b]0;x\\x07" in report.stdout
    finally:
        server.shutdown()
        server.server_close()


def test_tokens_a_server_did_not_count_are_counted_by_the_worker() -> None:
    """A remote backend's counts are optional (docs/backends.md): what it
    left out is counted by the worker (words, for a backend without a
    tokenizer), never billed as 0; a failed input bills none."""
    answers = Answers("w", Keys(), SimulatedBackend(0), None, None)  # type: ignore[arg-type]
    env = wire.Envelope("r", "g", "paid", "k", "three words here", 0, 1)
    both = Counted("an answer", tokens=7, input_tokens=5)
    assert answers._clipped(both, 0) == ("an answer", 7)
    assert answers._input_tokens(env, both) == 5
    neither = Counted("an answer", tokens=0, input_tokens=0)
    assert answers._clipped(neither, 0) == ("an answer", 2)
    assert answers._input_tokens(env, neither) == 3
    assert answers._clipped(Counted("", tokens=0), 0) == ("", 0)
    assert answers._input_tokens(env, BackendError("failed")) == 0
    [charge] = charges([env, env], shares(10_000, 2), [(3, 2), (0, 0)])
    assert charge == Charge("k", "paid", 2, 32, 10_000, 0, 3, 2)


def test_the_csv_header_follows_by_even_with_no_rows() -> None:
    empty = {"since": "a", "until": "b", "keys": []}
    assert as_csv(empty, periodic=True).startswith("period,key_id,tier,")
    assert as_csv(empty).startswith("key_id,tier,")
    row = {"key_id": "=cmd", "tier": "paid", "requests": 1, "gpu_ms": 1.5}
    assert as_csv({"keys": [row]}).splitlines()[1].startswith("'=cmd,paid,1,")
