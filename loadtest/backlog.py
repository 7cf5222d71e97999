"""Jobs in spare capacity: does a backlog of jobs cost synchronous traffic
anything, and how fast does it drain?

Runs the same open-loop synchronous load twice against one stack: once
alone, once right after submitting a backlog of jobs; reports the
synchronous latencies of both runs and the backlog's drain, second by
second (from the job queues' lengths in Redis).

    infergate up --workers 4 --policy loadtest/backlog-policy.yaml   # batches of 10: 400 req/s
    python -m infergate.loadtest.backlog --keys loadtest/keys.json \\
        --redis-url redis://127.0.0.1:6379/0 --rate 200 --duration 30 --jobs 5000
"""

import argparse
import asyncio
import itertools
import json
import random
import sys
import time
from typing import Any

import aiohttp
import redis
import uvloop
from infergate.base.keys import Keys
from infergate.loadtest.bench import Sample, one, percentile


async def synchronous(url: str, key: str, rate: float, duration_s: float) -> list[Sample]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=2000)) as session:
        start = time.perf_counter() + 0.05
        tasks = []
        for i in range(int(rate * duration_s)):
            due = start + i / rate
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            text = f"sync-{i}-{random.random():.6f}"  # never identical: no collapsing
            tasks.append(asyncio.create_task(one(session, url, key, "paid", text, due, None)))
        return list(await asyncio.gather(*tasks))


async def submit_jobs(url: str, key: str, n: int, concurrency: int = 100) -> int:
    accepted = 0
    async with aiohttp.ClientSession() as session:
        todo = iter(range(n))

        async def submitter() -> None:
            nonlocal accepted
            for i in todo:
                body = {"input": f"job-{i}-{random.random():.6f}"}
                async with session.post(
                    url, json=body, headers={"Authorization": "Bearer " + key}
                ) as r:
                    accepted += r.status == 202

        await asyncio.gather(*(submitter() for _ in range(concurrency)))
    return accepted


def jobs_queued(client: redis.Redis, keys: Keys) -> int:
    return sum(int(client.llen(q)) for q in keys.job_queues)


async def drain_timeline(client: redis.Redis, keys: Keys, stop: asyncio.Event) -> list[int]:
    out = []
    while not stop.is_set():
        out.append(await asyncio.to_thread(jobs_queued, client, keys))
        await asyncio.sleep(1.0)
    return out


def summary(samples: list[Sample]) -> dict[str, Any]:
    ok = sorted(s.latency_ms for s in samples if s.status == 200)
    return {
        "sent": len(samples),
        "ok": len(ok),
        "p50_ms": round(percentile(ok, 50), 1),
        "p95_ms": round(percentile(ok, 95), 1),
        "p99_ms": round(percentile(ok, 99), 1),
    }


async def run(args: argparse.Namespace, keys_file: dict[str, str]) -> dict[str, Any]:
    base = args.url.rstrip("/")
    client = redis.Redis.from_url(args.redis_url)
    keys = Keys(args.namespace)
    alone = summary(
        await synchronous(base + "/v1/inference", keys_file["paid"], args.rate, args.duration)
    )
    submitted_at = time.perf_counter()
    accepted = await submit_jobs(base + "/v1/jobs", keys_file[args.jobs_tier], args.jobs)
    submit_s = time.perf_counter() - submitted_at
    stop = asyncio.Event()
    timeline = asyncio.create_task(drain_timeline(client, keys, stop))
    with_backlog = summary(
        await synchronous(base + "/v1/inference", keys_file["paid"], args.rate, args.duration)
    )
    while jobs_queued(client, keys) > 0 and time.perf_counter() - submitted_at < 600:  # noqa: ASYNC110
        await asyncio.sleep(0.5)  # pacing: a poll of Redis twice a second
    drained_s = time.perf_counter() - submitted_at
    stop.set()
    queued = await timeline
    client.close()
    draining = [a - b for a, b in itertools.pairwise(queued) if a > 0]
    return {
        "synchronous_alone": alone,
        "synchronous_with_backlog": with_backlog,
        "jobs_accepted": accepted,
        "jobs_submit_s": round(submit_s, 1),
        "backlog_drained_after_s": round(drained_s, 1),
        # While jobs were queued (with the synchronous load running beside them).
        "jobs_started_per_s": round(sum(draining) / max(1, len(draining)), 1),
        "jobs_queued_each_second": queued,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m infergate.loadtest.backlog")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--keys", required=True)
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--namespace", default="infergate")
    p.add_argument("--rate", type=float, default=200.0, help="synchronous paid req/s")
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--jobs", type=int, default=5000)
    p.add_argument("--jobs-tier", default="free")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    with open(args.keys) as f:
        keys_file = json.load(f)
    report = uvloop.run(run(args, keys_file))
    print(json.dumps({k: v for k, v in report.items() if k != "jobs_queued_each_second"}, indent=2))
    print("jobs queued, each second:", report["jobs_queued_each_second"])
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
