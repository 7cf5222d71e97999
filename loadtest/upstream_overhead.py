"""What infergate adds in front of a model server: the same requests sent
straight to the server and through a gateway, each by a closed loop of
``--concurrency`` clients (distinct inputs), one after the other in one
sitting. At concurrency 1 it says the latency infergate adds (p50, p99);
at the server's saturation, the share of its throughput kept.

    python -m infergate.loadtest.upstream_overhead --kind kserve-v2 \\
        --upstream http://127.0.0.1:8000 --model echo \\
        --gateway http://127.0.0.1:8080 --key KEY --concurrency 1 --requests 300

``--kind openai`` sends ``/v1/completions`` (``--max-tokens``, temperature 0)
straight and ``/v1/inference`` with the same ``max_tokens`` through.
"""

import argparse
import asyncio
import json
import time
from typing import Any

import aiohttp
from infergate.loadtest.bench import percentile


def _direct(args: argparse.Namespace, text: str) -> tuple[str, dict[str, Any]]:
    if args.kind == "kserve-v2":
        tensor = {"name": args.input, "shape": [1, 1], "datatype": "BYTES", "data": [text]}
        return f"{args.upstream}/v2/models/{args.model}/infer", {"inputs": [tensor]}
    body = {"prompt": text, "max_tokens": args.max_tokens, "temperature": 0}
    if args.model:
        body["model"] = args.model
    return f"{args.upstream}/v1/completions", body


def _through(args: argparse.Namespace, text: str) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"input": text}
    if args.kind == "openai":
        body["parameters"] = {"max_tokens": args.max_tokens}
    if args.gateway_model:
        body["model"] = args.gateway_model
    return f"{args.gateway}/v1/inference", body


async def _run(args: argparse.Namespace, way: str) -> dict[str, Any]:
    make = _direct if way == "direct" else _through
    headers = {"Content-Type": "application/json"}
    if way == "through":
        headers["Authorization"] = f"Bearer {args.key}"
    latencies: list[float] = []
    failed = 0
    counter = iter(range(args.requests))

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal failed
        for i in counter:
            url, body = make(args, f"{way} request {i} of a run {args.run}")
            started = time.perf_counter()
            async with session.post(url, data=json.dumps(body), headers=headers) as resp:
                await resp.read()
                ok = resp.status == 200
            latencies.append((time.perf_counter() - started) * 1000)
            failed += not ok

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        started = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(args.concurrency)))
        elapsed = time.perf_counter() - started
    latencies.sort()
    return {
        "way": way,
        "requests": len(latencies),
        "failed": failed,
        "rps": round(len(latencies) / elapsed, 1),
        "p50_ms": round(percentile(latencies, 50), 2),
        "p99_ms": round(percentile(latencies, 99), 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m infergate.loadtest.upstream_overhead")
    p.add_argument("--kind", choices=("kserve-v2", "openai"), required=True)
    p.add_argument("--upstream", required=True, help="the server's base URL")
    p.add_argument("--model", default="", help="the server's model name")
    p.add_argument("--input", default="text", help="kserve-v2: the input tensor's name")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--gateway", required=True)
    p.add_argument("--gateway-model", default="", help="the model's name in infergate's policy")
    p.add_argument("--key", required=True)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--run", default=str(int(time.time())), help="makes this run's inputs distinct")
    p.add_argument("--warm-up", type=int, default=20, help="requests each way first, not counted")
    args = p.parse_args(argv)
    results = []
    for way in ("direct", "through"):
        counted = args.requests
        args.requests = args.warm_up
        asyncio.run(_run(args, way))
        args.requests = counted
        results.append(asyncio.run(_run(args, way)))
    for r in results:
        print(json.dumps(r))
    direct, through = results
    print(
        json.dumps(
            {
                "p50_added_ms": round(through["p50_ms"] - direct["p50_ms"], 2),
                "p99_added_ms": round(through["p99_ms"] - direct["p99_ms"], 2),
                "throughput_kept": round(through["rps"] / direct["rps"], 3),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
